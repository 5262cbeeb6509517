"""Ingress side of the GLM-Image graph: ``POST /v1/images/generations`` -> stage calls -> OpenAI response.

Contract: ``GlmImageFrontend(spec, stages)`` serves one route with the diffusion kit's request and response shapes and
checks (size, count, steps, prompt length: 400s before any stage is called). It opens the four stage calls at
once (ar, text_encoder, dit, vae: each finds its input on the data plane by key) and returns the images with
their step metrics. Whatever ends the request, every stage call is cancelled and the request's payloads freed
(``StageCalls.stream``): the AR's KV blocks, the DiT's rows and every payload.

What differs from Qwen-Image: sizes are multiples of 32 (the AR model's token grid); ``guidance_scale`` (alias
``true_cfg_scale``) is the CFG scale, default the pipeline's 1.5; the unconditional branch is fixed by the model
(visual tokens dropped, glyphs of ""), so ``negative_prompt`` is refused, as is cache acceleration (no cache-dit
support for this transformer). The seed seeds the AR's sampling and the DiT's noise, as the pipeline's
generator does.
"""

from __future__ import annotations

import os
from typing import Any

from omni_serve.api.errors import bad_request
from omni_serve.api.images import ImageGenerationRequest, ImageGenerationResponse
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.frontend import Frontend, RequestContext, Route
from omni_serve.families.glm_image.messages import DecodeCall, GlmDenoiseCall, PriorCall, PriorDone, TextEncodeCall
from omni_serve.families.glm_image.spec import GlmImageGraphSpec
from omni_serve.kits.diffusion.frontend import ImageRequestChecks, collect_images, image_response
from omni_serve.models.glm_image_layout import GRID_FACTOR
from omni_serve.request_ids import new_request_id


class GlmImageRequestChecks(ImageRequestChecks):
    max_prompt_tokens = 2048  # the pipeline's max_sequence_length

    def __init__(self, spec: GlmImageGraphSpec):
        from transformers import AutoTokenizer

        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(spec.checkpoint, "processor"))
        self.multiple = GRID_FACTOR
        self.guidance_embeds = False

    def guidance(self, req) -> tuple[float, None]:
        if req.negative_prompt is not None:
            raise bad_request("negative_prompt is not supported by this model: its unconditional branch is fixed.",
                              param="negative_prompt")
        scale = req.guidance_scale if req.guidance_scale is not None else req.true_cfg_scale
        return (self.spec.default_guidance_scale if scale is None else scale), None

    def cache(self, req) -> None:
        if req.cache is not None and req.cache.mode not in (None, "off"):
            raise bad_request("cache acceleration is not available for this model.", param="cache.mode")
        return None


class GlmImageFrontend(Frontend):
    routes = (Route("/v1/images/generations", "images", "images_generations", ImageGenerationRequest,
                    summary="Create images from a prompt (OpenAI images.generate)."),)

    def __init__(self, spec: GlmImageGraphSpec, stages: StageCalls):
        super().__init__(spec, stages)
        self.checks = GlmImageRequestChecks(spec)
        self.checks.check_size(*spec.default_dimensions(), param="default_size")

    def _calls(self, req: ImageGenerationRequest) -> tuple[str, dict[str, Any]]:
        c = self.checks
        width, height, steps = c.size_and_steps(req, self.spec.default_dimensions())
        scale, _ = c.guidance(req)
        c.cache(req)
        rid, seed = new_request_id("img"), c.seed(req.seed)
        calls = {
            "ar": PriorCall(request_id=rid, prompt=req.prompt, height=height, width=width, seed=seed),
            "text_encoder": TextEncodeCall(request_id=rid, prompt=req.prompt, negative_prompt="" if scale > 1 else None),
            "dit": GlmDenoiseCall(request_id=rid, n=req.n, height=height, width=width, num_steps=steps, seed=seed,
                                  guidance_scale=scale),
            "vae": DecodeCall(request_id=rid, height=height, width=width, output_format=req.output_format or "png",
                              return_latents=req.return_latents),
        }
        return rid, calls

    async def images_generations(self, req: ImageGenerationRequest, ctx: RequestContext) -> ImageGenerationResponse:
        rid, calls = self._calls(req)
        tokens = await self.checks.prompt_tokens(req)
        others: list = []
        images, done = await collect_images(self.stages, rid, calls, ctx.timeout_s, others=others)
        prior = next((o for o in others if isinstance(o, PriorDone)), None)
        return image_response(images, done, None, req.n, prior.prompt_tokens if prior else tokens)
