"""GLM-Image as a stage graph: AR visual tokens -> DiT denoising loop -> VAE, behind ``POST /v1/images/generations``.

The family plug-in (``omni_serve.graph.family``): ``FAMILY`` names the graph declaration (``graph``), the spec
(``spec``), the ingress-side frontend (``frontend``) and the checkpoint writer; replica-side code lives in
``replica/``. ``build_app(args)`` is the Serve entry point: ``serve run omni_serve.families.glm_image:build_app
checkpoint=DIR`` or ``omni-serve serve --graph glm_image checkpoint=DIR``; see docs/glm_image.md.
"""

from __future__ import annotations

from omni_serve.deployments.entry import serve_builder
from omni_serve.graph.family import Family
from omni_serve.families.glm_image.graph import GRAPH
from omni_serve.families.glm_image.spec import GlmImageGraphSpec

FAMILY = Family(
    module=__name__, graph=GRAPH, spec=GlmImageGraphSpec, frontend=f"{__name__}.frontend:GlmImageFrontend",
    checkpoint_marker="vision_language_encoder/config.json",
    checkpoint_writer="omni_serve.checkpoints.glm_image:make_checkpoint",
    description=("GLM-Image text-to-image: an autoregressive model writes visual tokens that condition a DiT denoising "
                 "loop (with T5 glyph embeddings of quoted text), then a VAE decoder."))

build_app = serve_builder(FAMILY)
