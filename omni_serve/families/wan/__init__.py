"""Wan 2.1 text-to-video as a stage graph: text_encoder -> dit (denoising loop) -> vae, behind OpenAI's Videos API
(``/v1/videos``: jobs that any ingress replica answers for, kept in a database).

The family plug-in (``omni_serve.graph.family``): its stages run the diffusion kit's replica code on Wan's adapters
(``omni_serve.models.wan``). ``build_app(args)`` is the Serve entry point: ``omni-serve serve --graph wan
checkpoint=DIR``, ``serve run omni_serve.families.wan:build_app checkpoint=DIR``, or a Serve config file.
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.families.wan.graph import GRAPH
from omni_serve.families.wan.spec import WanGraphSpec
from omni_serve.graph.family import Family

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=WanGraphSpec, frontend=f"{__name__}.frontend:WanFrontend",
    checkpoint_marker="model_index.json", checkpoint_writer="omni_serve.checkpoints.wan:make_checkpoint",
    description="Wan 2.1 text-to-video: UMT5 text encoder, video DiT denoising loop, 3D VAE decoder; jobs.")

build_app = serve_builder(FAMILY)
