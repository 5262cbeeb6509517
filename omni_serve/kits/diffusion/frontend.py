"""Ingress-side pieces of the image families: request checks and the OpenAI images response.

Contract: ``ImageRequestChecks(spec, tokenizer_dir)`` turns an image request's size, count, steps, prompt length,
guidance and cache settings into the values every stage call shares, raising OpenAI-style 400s before any stage
is called. ``collect_images`` runs a request's stage calls and gathers the VAE's images and the DiT's step
counts; ``image_response`` builds the ``ImageGenerationResponse`` with per-image step metrics.
"""

from __future__ import annotations

import asyncio
import base64
import random
from typing import Any

from omni_serve.api.errors import bad_request
from omni_serve.api.images import ImageData, ImageGenerationResponse, ImageLatents, ImageMetrics, ImageUsage
from omni_serve.api.limits import check_prompt_chars
from omni_serve.graph.calls import StageCalls
from omni_serve.kits.diffusion.messages import CacheSettings, DenoiseDone, ImagesEncoded
from omni_serve.models.qwen_image_layout import guidance_embeds, pixel_multiple


class ImageRequestChecks:
    """The graph's limits on an image request (size, count, steps, prompt length, cache), as 400s, and the
    settings every stage call of the request shares (CFG scale, guidance, seed, cache)."""

    max_prompt_tokens = 1024  # diffusers' QwenImagePipeline.tokenizer_max_length

    def __init__(self, spec: Any, tokenizer_dir: str):
        from transformers import AutoTokenizer

        self.spec = spec
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.multiple = pixel_multiple(spec.checkpoint)
        self.guidance_embeds = guidance_embeds(spec.checkpoint)

    def check_size(self, width: int, height: int, param: str = "size") -> None:
        check_size(self.spec, self.multiple, width, height, param)

    def size_and_steps(self, req, default_dimensions: tuple[int, int] | None) -> tuple[int, int, int]:
        """(width, height, steps) of a request, after the model, count, size and steps checks."""
        self.check_model(req.model)
        self.check_count(req.n)
        width, height = req.dimensions(default_dimensions)
        self.check_size(width, height)
        return width, height, self.steps(req.num_inference_steps)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.spec.model_name:
            raise bad_request(f"The model {model!r} does not exist; this server serves {self.spec.model_name!r}.",
                              param="model", code="model_not_found")

    def check_count(self, n: int) -> None:
        if n > self.spec.max_images:
            raise bad_request(f"n must be between 1 and {self.spec.max_images}.", param="n")

    def steps(self, asked: int | None) -> int:
        steps = asked or self.spec.default_steps
        if steps > self.spec.max_steps:
            raise bad_request(f"num_inference_steps must be between 1 and {self.spec.max_steps}.",
                              param="num_inference_steps")
        return steps

    async def prompt_tokens(self, req) -> int:
        """The prompt's tokens (400 beyond ``max_prompt_tokens``), after the characters of the prompt and negative
        prompt are checked against ``limits.max_prompt_chars``; tokenizing runs off the event loop."""
        check_prompt_chars({"prompt": req.prompt, "negative_prompt": req.negative_prompt}, self.spec.limits)

        def count() -> int:
            tokens = self.count_tokens(req.prompt, "prompt")
            if req.negative_prompt is not None:
                self.count_tokens(req.negative_prompt, "negative_prompt")
            return tokens

        return await asyncio.to_thread(count)

    def count_tokens(self, text: str, param: str) -> int:
        tokens = len(self.tokenizer(text).input_ids)
        if tokens > self.max_prompt_tokens:
            raise bad_request(f"{param} has {tokens} tokens; at most {self.max_prompt_tokens} are accepted.",
                              param=param, code="context_length_exceeded")
        return tokens

    def guidance(self, req) -> tuple[float, float | None]:
        """(true-CFG scale, distilled guidance or None). Non-distilled transformers (Qwen-Image) take
        guidance_scale as the true-CFG scale."""
        s = self.spec
        cfg_scale = req.true_cfg_scale
        if cfg_scale is None and not self.guidance_embeds:
            cfg_scale = req.guidance_scale
        cfg_scale = s.default_true_cfg_scale if cfg_scale is None else cfg_scale
        guidance = (req.guidance_scale if req.guidance_scale is not None else s.default_guidance_scale) \
            if self.guidance_embeds else None
        return cfg_scale, guidance

    def cache(self, req) -> CacheSettings | None:
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
            settings = settings.model_copy(update=asked)
        return None if settings.mode == "off" else settings

    @staticmethod
    def seed(asked: int | None) -> int:
        return asked if asked is not None else random.randrange(2**31)


def image_response(images: list[ImageData], done: DenoiseDone, cache: CacheSettings | None, n: int,
                   tokens: int) -> ImageGenerationResponse:
    metrics = ImageMetrics(
        num_inference_steps=done.num_steps, computed_steps=[done.computed_steps] * n,
        cached_steps=[done.cached_steps] * n, cache_mode=cache.mode if cache else "off", true_cfg=done.true_cfg)
    return ImageGenerationResponse(data=images, usage=ImageUsage(input_tokens=tokens, total_tokens=tokens),
                                   metrics=metrics)


def image_data(encoded: ImagesEncoded) -> list[ImageData]:
    """The response's data items of the VAE's output: each image base64, with its latents when they came along."""
    b64 = [base64.b64encode(img).decode() for img in encoded.images]
    if not encoded.latents:
        return [ImageData(b64_json=img) for img in b64]
    return [ImageData(b64_json=img, latents=ImageLatents(data=base64.b64encode(lat).decode(),
                                                         shape=encoded.latent_shape))
            for img, lat in zip(b64, encoded.latents, strict=True)]


def check_size(spec: Any, multiple: int, width: int, height: int, param: str = "size") -> None:
    """A 400 unless ``width`` and ``height`` are positive multiples of ``multiple`` within the graph's
    ``max_side`` and ``max_pixels`` (``spec``'s)."""
    m = multiple
    if width % m or height % m or width < m or height < m:
        raise bad_request(f"size {width}x{height} is not supported: width and height must be positive "
                          f"multiples of {m}.", param=param, code="invalid_size")
    if max(width, height) > spec.max_side or width * height > spec.max_pixels:
        raise bad_request(f"size {width}x{height} is too large: at most {spec.max_side} pixels a side and "
                          f"{spec.max_pixels} pixels in all.", param=param, code="invalid_size")


async def collect_images(stages: StageCalls, request_id: str, calls: dict[str, Any], timeout_s: float,
                         inputs: dict[str, Any] | None = None,
                         others: list | None = None) -> tuple[list[ImageData], DenoiseDone]:
    """Run a request's stage calls (after putting ``inputs`` on the ingress' edges); (the response's data items:
    the encoded images, with their latents if the VAE call asked for them; the DiT's step counts). The stages'
    other outputs are appended to ``others`` when given."""
    images: list[ImageData] = []
    done: DenoiseDone | None = None
    async for _, out in stages.stream(request_id, calls, timeout_s, inputs=inputs):
        if isinstance(out, ImagesEncoded):
            images.extend(image_data(out))
        elif isinstance(out, DenoiseDone):
            done = out
        elif others is not None:
            others.append(out)
    return images, done
