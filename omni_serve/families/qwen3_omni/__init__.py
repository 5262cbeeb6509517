"""Qwen3-Omni (MoE) as a stage graph: encoder -> thinker -> talker (+ code predictor) -> code2wav, behind
``POST /v1/chat/completions``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``: both thinker
layouts), the spec (``spec``), the ingress-side frontend (``frontend``) and the checkpoint writer; replica-side
code lives in ``replica/``. ``build_app(args)`` is the Serve entry point: ``serve run
omni_serve.families.qwen3_omni:build_app checkpoint=DIR``, ``omni-serve serve --graph qwen3_omni checkpoint=DIR``,
or a Serve config file (see ``omni_serve/configs/qwen3_omni.yaml``).
"""

from __future__ import annotations

from typing import Any

from omni_serve.graph.family import Family
from omni_serve.families.qwen3_omni.graph import GRAPH
from omni_serve.families.qwen3_omni.spec import Qwen3OmniGraphSpec

FAMILY = Family(
    name="qwen3_omni", module=__name__, graph=GRAPH, spec=Qwen3OmniGraphSpec,
    description="Qwen3-Omni (MoE) thinker-talker: text, audio and image in; text and speech out.",
    frontend="omni_serve.families.qwen3_omni.frontend:Qwen3OmniFrontend",
    checkpoint_marker="config.json",
    checkpoint_writer="omni_serve.checkpoints.qwen3_omni:make_checkpoint",
)


def build_spec(args: dict[str, Any] | None) -> Qwen3OmniGraphSpec:
    """Validate ``args``; the checkpoint path is made absolute so every replica finds it whatever its cwd."""
    return FAMILY.validate(args)


def build_app(args: dict[str, Any] | None = None):
    from omni_serve.deployments.builder import build_app as build

    return build(FAMILY, args)
