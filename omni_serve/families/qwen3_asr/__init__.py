"""Qwen3-ASR as a stage graph: audio encoder -> LLM, behind ``POST /v1/audio/transcriptions``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``), the spec
(``spec``), the ingress-side frontend (``frontend``) and the checkpoint writer; replica-side code lives in
``replica/``. ``build_app(args)`` is the Serve entry point: ``serve run omni_serve.families.qwen3_asr:build_app
checkpoint=DIR`` or ``omni-serve serve --graph qwen3_asr checkpoint=DIR``; see docs/qwen3_asr.md.
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.families.qwen3_asr.graph import GRAPH
from omni_serve.families.qwen3_asr.spec import Qwen3ASRGraphSpec
from omni_serve.graph.family import Family

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=Qwen3ASRGraphSpec, frontend=f"{__name__}.frontend:Qwen3ASRFrontend",
    checkpoint_marker="processor_config.json",
    checkpoint_writer="omni_serve.checkpoints.qwen3_asr:make_checkpoint",
    description=("Qwen3-ASR speech recognition: an audio encoder whose embeddings fill the placeholders of a Qwen3 "
                 "LLM's prompt, which writes the transcript."))

build_app = serve_builder(FAMILY)
