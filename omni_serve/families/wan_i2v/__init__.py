"""Wan 2.1 image-to-video as a stage graph: text_encoder, image_encoder (CLIP) and vae_encoder (the first frame's
latents) -> dit (denoising loop) -> vae, behind OpenAI's Videos API with ``input_reference`` (``/v1/videos``: jobs
that any ingress replica answers for, kept in a database).

The family plug-in (``omni_serve.graph.family``): its stages run the diffusion kit's replica code and its own
encoders on Wan's adapters (``omni_serve.models.wan``, ``omni_serve.models.wan_i2v``). ``build_app(args)`` is the
Serve entry point: ``omni-serve serve --graph wan_i2v checkpoint=DIR``, ``serve run omni_serve.families.wan_i2v:
build_app checkpoint=DIR``, or a Serve config file.
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.families.wan_i2v.graph import GRAPH
from omni_serve.families.wan_i2v.spec import WanImageToVideoGraphSpec
from omni_serve.graph.family import Family

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=WanImageToVideoGraphSpec,
    frontend=f"{__name__}.frontend:WanImageToVideoFrontend",
    checkpoint_marker="image_encoder/config.json",  # what text-to-video checkpoints lack
    checkpoint_writer="omni_serve.checkpoints.wan:make_i2v_checkpoint",
    description=("Wan 2.1 image-to-video: the first frame through a CLIP image encoder and the 3D VAE's encoder "
                 "conditions the video DiT's denoising loop; jobs."))

build_app = serve_builder(FAMILY)
