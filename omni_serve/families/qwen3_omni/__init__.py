"""Qwen3-Omni (MoE) as a stage graph: encoder -> thinker -> talker (+ code predictor) -> code2wav, behind
``POST /v1/chat/completions``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``: both thinker
layouts), the spec (``spec``), the ingress-side frontend (``frontend``) and the checkpoint writer; replica-side
code lives in ``replica/``. ``build_app(args)`` is the Serve entry point: ``serve run
omni_serve.families.qwen3_omni:build_app checkpoint=DIR``, ``omni-serve serve --graph qwen3_omni checkpoint=DIR``,
or a Serve config file (see ``omni_serve/configs/qwen3_omni.yaml``).
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.graph.family import Family
from omni_serve.families.qwen3_omni.graph import GRAPH
from omni_serve.families.qwen3_omni.spec import Qwen3OmniGraphSpec

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=Qwen3OmniGraphSpec, frontend=f"{__name__}.frontend:Qwen3OmniFrontend",
    checkpoint_marker="config.json", checkpoint_writer="omni_serve.checkpoints.qwen3_omni:make_checkpoint",
    description="Qwen3-Omni (MoE) thinker-talker: text, audio and image in; text and speech out.")

build_app = serve_builder(FAMILY)
