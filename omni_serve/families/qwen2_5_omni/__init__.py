"""Qwen2.5-Omni as a stage graph: encoder -> thinker -> talker -> code2wav, behind ``POST /v1/chat/completions``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``: both thinker
layouts), the spec (``spec``), the ingress-side frontend (``frontend``) and the checkpoint writer; replica-side
code lives in ``replica/``. ``build_app(args)`` is the Serve entry point: ``serve run
omni_serve.families.qwen2_5_omni:build_app checkpoint=DIR``, ``omni-serve serve checkpoint=DIR``, or a Serve config
file (``applications[].import_path`` + ``args``); see ``omni_serve/configs/qwen2_5_omni.yaml`` and
``qwen2_5_omni_disagg.yaml``.
"""

from __future__ import annotations

from typing import Any

from omni_serve.graph.family import Family
from omni_serve.families.qwen2_5_omni.graph import GRAPH
from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec

FAMILY = Family(
    name="qwen2_5_omni", module=__name__, graph=GRAPH, spec=OmniGraphSpec,
    description="Qwen2.5-Omni thinker-talker: text, audio and image in; text and speech out.",
    frontend="omni_serve.families.qwen2_5_omni.frontend:OmniFrontend",
    checkpoint_marker="config.json",
    checkpoint_writer="omni_serve.checkpoints.qwen2_5_omni:make_checkpoint",
)


def build_spec(args: dict[str, Any] | None) -> OmniGraphSpec:
    """Validate ``args``; the checkpoint path is made absolute so every replica finds it whatever its cwd."""
    return FAMILY.validate(args)


def build_app(args: dict[str, Any] | None = None):
    from omni_serve.deployments.builder import build_app as build

    return build(FAMILY, args)
