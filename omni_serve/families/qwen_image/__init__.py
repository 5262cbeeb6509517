"""Qwen-Image as a stage graph: text_encoder -> dit (denoising loop) -> vae, behind ``POST /v1/images/generations``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``), the spec
(``spec``), the ingress-side frontend (``frontend``), and the checkpoint writer; its stages run the diffusion
kit's replica code (``omni_serve.kits.diffusion.replica``) on Qwen-Image's adapters. ``build_app(args)`` is the
Serve entry point: ``serve run omni_serve.families.qwen_image:build_app checkpoint=DIR``, ``omni-serve serve
--graph qwen_image checkpoint=DIR``, or a Serve config file (``applications[].import_path`` + ``args``).
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.graph.family import Family
from omni_serve.families.qwen_image.graph import GRAPH
from omni_serve.families.qwen_image.spec import QwenImageGraphSpec

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=QwenImageGraphSpec, frontend=f"{__name__}.frontend:QwenImageFrontend",
    checkpoint_marker="model_index.json", checkpoint_writer="omni_serve.checkpoints.qwen_image:make_checkpoint",
    description="Qwen-Image text-to-image: Qwen2.5-VL text encoder, MMDiT denoising loop, VAE decoder.")

build_app = serve_builder(FAMILY)
