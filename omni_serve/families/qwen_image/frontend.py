"""Ingress side of the Qwen-Image graph: ``POST /v1/images/generations`` -> stage calls -> OpenAI response.

Contract: ``QwenImageFrontend(spec, stages)`` serves one route, ``images_generations(body, ctx)``: it validates the
request against the graph's limits (400s are raised before any stage is called, ``ImageRequestChecks``), opens
the three stage calls at once (text_encoder, dit, vae: each finds its input on the data plane by key) and returns
an ``ImageGenerationResponse`` with the images and per-image step metrics. Whatever ends the request, every stage
call is cancelled and the request's data-plane payloads are freed (``StageCalls.stream``).
"""

from __future__ import annotations

import os
from typing import Any

from omni_serve.api.images import ImageGenerationRequest, ImageGenerationResponse
from omni_serve.families.qwen_image.spec import QwenImageGraphSpec
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.frontend import Frontend, RequestContext, Route
from omni_serve.kits.diffusion.frontend import ImageRequestChecks, collect_images, image_response
from omni_serve.kits.diffusion.messages import DecodeCall, DenoiseCall, TextEncodeCall
from omni_serve.models.qwen_image_layout import TOKENIZER_SUBFOLDER
from omni_serve.request_ids import new_request_id


class QwenImageFrontend(Frontend):
    routes = (Route("/v1/images/generations", "images", "images_generations", ImageGenerationRequest,
                    summary="Create images from a prompt (OpenAI images.generate)."),)

    def __init__(self, spec: QwenImageGraphSpec, stages: StageCalls):
        super().__init__(spec, stages)
        self.checks = ImageRequestChecks(spec, os.path.join(spec.checkpoint, TOKENIZER_SUBFOLDER))
        self.checks.check_size(*spec.default_dimensions(), param="default_size")

    def _calls(self, req: ImageGenerationRequest) -> tuple[str, dict[str, Any]]:
        c = self.checks
        width, height, steps = c.size_and_steps(req, self.spec.default_dimensions())
        cfg_scale, guidance = c.guidance(req)
        rid = new_request_id("img")
        # CFG needs the negative prompt's embeddings; without CFG it is not encoded at all.
        negative = req.negative_prompt if cfg_scale > 1 else None
        calls = {
            "text_encoder": TextEncodeCall(request_id=rid, prompt=req.prompt, negative_prompt=negative),
            "dit": DenoiseCall(request_id=rid, n=req.n, height=height, width=width, num_steps=steps,
                               seed=c.seed(req.seed), true_cfg_scale=cfg_scale, guidance_scale=guidance,
                               cache=c.cache(req)),
            "vae": DecodeCall(request_id=rid, height=height, width=width, output_format=req.output_format or "png",
                              return_latents=req.return_latents),
        }
        return rid, calls

    async def images_generations(self, req: ImageGenerationRequest, ctx: RequestContext) -> ImageGenerationResponse:
        rid, calls = self._calls(req)
        tokens = await self.checks.prompt_tokens(req)
        images, done = await collect_images(self.stages, rid, calls, ctx.timeout_s)
        return image_response(images, done, calls["dit"].cache, req.n, tokens)
