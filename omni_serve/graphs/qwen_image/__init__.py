"""Qwen-Image as a Ray Serve stage graph: text_encoder -> dit (denoising loop) -> vae, plus the ingress.

``build_app(args)`` validates ``args`` against ``QwenImageGraphSpec`` (dotted keys allowed) and returns the
application: ``serve run omni_serve.graphs.qwen_image:build_app checkpoint=DIR``, ``omni-serve serve --graph
qwen_image checkpoint=DIR``, or a Serve config file (``applications[].import_path`` + ``args``).
"""

from __future__ import annotations

from typing import Any

from ray import serve

from omni_serve.graphs.app import build_graph_app, validate_spec
from omni_serve.graphs.qwen_image.spec import QwenImageGraphSpec

STAGE_RUNNERS = {
    "text_encoder": "omni_serve.graphs.qwen_image.stages:TextEncoderRunner",
    "dit": "omni_serve.graphs.qwen_image.stages:DiTRunner",
    "vae": "omni_serve.graphs.qwen_image.stages:VAERunner",
}
FRONTEND = "omni_serve.graphs.qwen_image.frontend:QwenImageFrontend"


def build_spec(args: dict[str, Any] | None) -> QwenImageGraphSpec:
    """Validate ``args``; the checkpoint path is made absolute so every replica finds it whatever its cwd."""
    return validate_spec(QwenImageGraphSpec, args, "model_index.json",
                         "write one with `omni-serve make-checkpoint qwen_image --size tiny DIR`")


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    return build_graph_app(build_spec(args), STAGE_RUNNERS, FRONTEND)
