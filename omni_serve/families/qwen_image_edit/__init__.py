"""Qwen-Image-Edit as a stage graph: the input image conditions the prompt encoder and, through the VAE encoder,
every DiT step; behind ``POST /v1/images/edits``.

The family plug-in (``omni_serve.graph.family``), built on Qwen-Image's: its DiT and VAE decoder are Qwen-Image's
adapters and programs, its request checks Qwen-Image's. ``build_app(args)`` is the Serve entry point:
``serve run omni_serve.families.qwen_image_edit:build_app checkpoint=DIR`` or ``omni-serve serve --graph
qwen_image_edit checkpoint=DIR``; see docs/qwen_image_edit.md.
"""

from __future__ import annotations

from typing import Any

from omni_serve.graph.family import Family
from omni_serve.families.qwen_image_edit.graph import GRAPH
from omni_serve.families.qwen_image_edit.spec import QwenImageEditGraphSpec

FAMILY = Family(
    name="qwen_image_edit", module=__name__, graph=GRAPH, spec=QwenImageEditGraphSpec,
    description="Qwen-Image-Edit image editing: the input image through Qwen2.5-VL's vision tower and the VAE "
                "encoder conditions the MMDiT denoising loop.",
    frontend="omni_serve.families.qwen_image_edit.frontend:QwenImageEditFrontend",
    checkpoint_marker="processor/preprocessor_config.json",  # what Qwen-Image's checkpoints lack
    checkpoint_writer="omni_serve.checkpoints.qwen_image_edit:make_checkpoint",
)


def build_app(args: dict[str, Any] | None = None):
    from omni_serve.deployments.builder import build_app as build

    return build(FAMILY, args)
