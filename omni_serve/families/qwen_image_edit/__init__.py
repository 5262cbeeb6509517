"""Qwen-Image-Edit as a stage graph: the input image conditions the prompt encoder and, through the VAE encoder,
every DiT step; behind ``POST /v1/images/edits``.

The family plug-in (``omni_serve.graph.family``), built on the diffusion kit: its DiT and VAE decoder run the
kit's programs on Qwen-Image's adapters, its request checks are the kit's. ``build_app(args)`` is the Serve entry
point: ``serve run omni_serve.families.qwen_image_edit:build_app checkpoint=DIR`` or ``omni-serve serve --graph
qwen_image_edit checkpoint=DIR``; see docs/qwen_image_edit.md.
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.graph.family import Family
from omni_serve.families.qwen_image_edit.graph import GRAPH
from omni_serve.families.qwen_image_edit.spec import QwenImageEditGraphSpec

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=QwenImageEditGraphSpec, frontend=f"{__name__}.frontend:QwenImageEditFrontend",
    checkpoint_marker="processor/preprocessor_config.json",  # what Qwen-Image checkpoints lack
    checkpoint_writer="omni_serve.checkpoints.qwen_image_edit:make_checkpoint",
    description=("Qwen-Image-Edit image editing: the input image through Qwen2.5-VL's vision tower and the VAE encoder "
                 "conditions the MMDiT denoising loop."))

build_app = serve_builder(FAMILY)
