"""Ingress-side logic of the Qwen-Image graph: OpenAI image request -> stage calls -> OpenAI response.

Contract: ``QwenImageFrontend(spec, handles)``; ``await generate_images(request)`` validates the request
against the graph's limits (400s are raised before any stage is called), opens the three stage calls at
once (text_encoder, dit, vae: each finds its input on the data plane by key) and returns an
``ImageGenerationResponse`` with the images and per-image step metrics. Whatever ends the request,
every stage call is cancelled and the request's data-plane payloads are freed (``graphs.fanout``).
"""

from __future__ import annotations

import base64
import json
import os
import random
from typing import Any

from omni_serve.api.errors import bad_request
from omni_serve.api.images import ImageData, ImageGenerationRequest, ImageGenerationResponse, ImageMetrics, ImageUsage
from omni_serve.graphs.fanout import probe_stages, stage_events
from omni_serve.graphs.qwen_image.spec import QwenImageGraphSpec
from omni_serve.models.qwen_image import pixel_multiple
from omni_serve.request_ids import new_request_id
from omni_serve.transport.base import edge_connectors


class QwenImageFrontend:
    def __init__(self, spec: QwenImageGraphSpec, handles: dict[str, Any]):
        from transformers import AutoTokenizer

        self.spec, self.handles = spec, handles
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(spec.checkpoint, "tokenizer"))
        self.multiple = pixel_multiple(spec.checkpoint)
        with open(os.path.join(spec.checkpoint, "transformer", "config.json")) as f:
            self.guidance_embeds = bool(json.load(f).get("guidance_embeds", False))
        self.max_prompt_tokens = 1024  # diffusers' QwenImagePipeline.tokenizer_max_length
        self.connectors = edge_connectors(spec.edges, spec.data_plane)
        self._check_size(*spec.default_dimensions(), param="default_size")

    # -- validation -----------------------------------------------------------------------------------------
    def _check_size(self, width: int, height: int, param: str = "size") -> None:
        s, m = self.spec, self.multiple
        if width % m or height % m or width < m or height < m:
            raise bad_request(f"size {width}x{height} is not supported: width and height must be positive "
                              f"multiples of {m}.", param=param, code="invalid_size")
        if max(width, height) > s.max_side or width * height > s.max_pixels:
            raise bad_request(f"size {width}x{height} is too large: at most {s.max_side} pixels a side and "
                              f"{s.max_pixels} pixels in all.", param=param, code="invalid_size")

    def _cache(self, req: ImageGenerationRequest) -> dict[str, Any] | None:
        cfg = self.spec.stages.dit.params.cache
        settings = cfg.settings()
        if req.cache is not None:
            asked = req.cache.model_dump(exclude_none=True)
            if asked and not cfg.allow_request_override:
                raise bad_request("This server does not allow per-request cache settings.", param="cache")
            threshold = asked.get("residual_diff_threshold")
            if threshold is not None and threshold > cfg.max_request_threshold:
                raise bad_request(f"cache.residual_diff_threshold must be <= {cfg.max_request_threshold}.",
                                  param="cache.residual_diff_threshold")
            if "max_warmup_steps" in asked:
                # Warm-up beyond the last step changes nothing, and cache-dit lists the warm-up steps
                # (a 1e16 here was a MemoryError in the DiT, found by fuzzing).
                asked["max_warmup_steps"] = min(asked["max_warmup_steps"], self.spec.max_steps)
            settings.update(asked)
        return None if settings["mode"] == "off" else settings

    def _count_tokens(self, text: str, param: str) -> int:
        tokens = len(self.tokenizer(text).input_ids)
        if tokens > self.max_prompt_tokens:
            raise bad_request(f"{param} has {tokens} tokens; at most {self.max_prompt_tokens} are accepted.",
                              param=param, code="context_length_exceeded")
        return tokens

    def _prepare(self, req: ImageGenerationRequest) -> tuple[str, dict[str, dict[str, Any]], int]:
        s = self.spec
        if req.model is not None and req.model != s.model_name:
            raise bad_request(f"The model {req.model!r} does not exist; this server serves {s.model_name!r}.",
                              param="model", code="model_not_found")
        if req.n > s.max_images:
            raise bad_request(f"n must be between 1 and {s.max_images}.", param="n")
        width, height = req.dimensions(s.default_dimensions())
        self._check_size(width, height)
        steps = req.num_inference_steps or s.default_steps
        if steps > s.max_steps:
            raise bad_request(f"num_inference_steps must be between 1 and {s.max_steps}.",
                              param="num_inference_steps")
        tokens = self._count_tokens(req.prompt, "prompt")
        if req.negative_prompt is not None:
            self._count_tokens(req.negative_prompt, "negative_prompt")
        # Non-distilled transformers (Qwen-Image) take guidance_scale as the true-CFG scale.
        cfg_scale = req.true_cfg_scale
        if cfg_scale is None and not self.guidance_embeds:
            cfg_scale = req.guidance_scale
        cfg_scale = s.default_true_cfg_scale if cfg_scale is None else cfg_scale
        guidance = (req.guidance_scale if req.guidance_scale is not None else s.default_guidance_scale) \
            if self.guidance_embeds else None
        rid = new_request_id("img")
        seed = req.seed if req.seed is not None else random.randrange(2**31)
        # CFG needs the negative prompt's embeddings; without CFG it is not encoded at all.
        negative = req.negative_prompt if cfg_scale > 1 else None
        payloads = {
            "text_encoder": {"request_id": rid, "prompt": req.prompt, "negative_prompt": negative},
            "dit": {"request_id": rid, "n": req.n, "height": height, "width": width, "num_steps": steps,
                    "seed": seed, "true_cfg_scale": cfg_scale, "guidance_scale": guidance,
                    "cache": self._cache(req)},
            "vae": {"request_id": rid, "height": height, "width": width, "output_format": req.output_format},
        }
        return rid, payloads, tokens

    # -- running --------------------------------------------------------------------------------------------
    async def generate_images(self, req: ImageGenerationRequest,
                              timeout_s: float | None = None) -> ImageGenerationResponse:
        rid, payloads, tokens = self._prepare(req)
        images: list[bytes] = []
        dit: dict[str, Any] = {}
        async for stage, out in stage_events(self.handles, payloads, request_id=rid,
                                             timeout_s=timeout_s or self.spec.ingress.request_timeout_s,
                                             connectors=self.connectors):
            if stage == "vae":
                images.extend(out["images"])
            elif stage == "dit":
                dit = out
        cache = payloads["dit"]["cache"]
        metrics = ImageMetrics(
            num_inference_steps=dit["num_steps"], computed_steps=[dit["computed_steps"]] * req.n,
            cached_steps=[dit["cached_steps"]] * req.n, cache_mode=cache["mode"] if cache else "off",
            true_cfg=dit["true_cfg"])
        return ImageGenerationResponse(
            data=[ImageData(b64_json=base64.b64encode(img).decode()) for img in images],
            usage=ImageUsage(input_tokens=tokens, total_tokens=tokens), metrics=metrics)

    async def health(self) -> dict[str, Any]:
        return await probe_stages(self.handles)
