"""Qwen2.5-Omni as a stage graph: encoder -> thinker -> talker -> code2wav, behind ``POST /v1/chat/completions``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``: both thinker
layouts), the spec (``spec``), the ingress-side frontend (``frontend``) and the checkpoint writer; replica-side
code lives in ``replica/``. ``build_app(args)`` is the Serve entry point: ``serve run
omni_serve.families.qwen2_5_omni:build_app checkpoint=DIR``, ``omni-serve serve checkpoint=DIR``, or a Serve config
file (``applications[].import_path`` + ``args``); see ``omni_serve/configs/qwen2_5_omni.yaml`` and
``qwen2_5_omni_disagg.yaml``.
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.graph.family import Family
from omni_serve.families.qwen2_5_omni.graph import GRAPH
from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=OmniGraphSpec, frontend=f"{__name__}.frontend:Qwen25OmniFrontend",
    checkpoint_marker="config.json", checkpoint_writer="omni_serve.checkpoints.qwen2_5_omni:make_checkpoint",
    sizing=f"{__name__}.sizing:size_to_cluster",
    description="Qwen2.5-Omni thinker-talker: text, audio and image in; text and speech out.")

build_app = serve_builder(FAMILY)
