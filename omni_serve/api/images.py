"""OpenAI image-generation protocol models (``POST /v1/images/generations``), pydantic v2.

Contract:

* ``ImageGenerationRequest`` accepts what the official ``openai`` client's ``images.generate`` sends, plus
  omni_serve extensions for diffusion models (``seed``, ``num_inference_steps``, ``guidance_scale``,
  ``true_cfg_scale``, ``negative_prompt``, ``cache``, ``return_latents``). Unknown fields are ignored. Static
  rules (empty prompt, malformed ``size``, ``n`` and steps below 1, unsupported ``response_format``) fail validation
  and become 400s via ``omni_serve.api.errors``; limits that depend on the served graph (largest size,
  most steps, most images) are checked by the graph's frontend, also as 400s.
* ``ImageGenerationResponse`` is OpenAI's ``{created, data: [{b64_json}]}`` plus ``usage`` and an
  omni_serve ``metrics`` object (denoising steps computed vs served from cache, per image); with
  ``return_latents`` each data item also carries its final latents (``ImageLatents``).
"""

from __future__ import annotations

import re
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_SIZE = re.compile(r"^(\d{1,5})x(\d{1,5})$")


# Guidance scales are finite and bounded: JSON's `Infinity`/`NaN` would otherwise reach the denoising loop and turn
# every latent into inf/NaN (a 200 with a black image); useful scales are single digits, 100 leaves room.
MAX_GUIDANCE_SCALE = 100.0


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheOptions(_Lenient):
    """Per-request cache acceleration (omni_serve extension); bounded by the served stage's limits."""

    mode: Literal["off", "dbcache", "taylorseer"] | None = Field(
        default=None, description="'off', 'dbcache' (reuse residuals of unchanged steps) or 'taylorseer' "
                                  "(DBCache + TaylorSeer extrapolation); default: the stage's setting.")
    residual_diff_threshold: float | None = Field(
        default=None, gt=0, description="DBCache: relative residual change below which a step is served from cache.")
    max_warmup_steps: int | None = Field(default=None, ge=0, description="Steps always computed before caching.")


class ImageGenerationRequest(_Lenient):
    prompt: str = Field(description="What to draw.")
    model: str | None = Field(default=None, description="Served model name (default: the served one).")
    n: int = Field(default=1, ge=1, description="Images to generate for the prompt.")
    size: str | None = Field(default=None, description="'WIDTHxHEIGHT' in pixels, or 'auto' (the default size).")
    response_format: Literal["b64_json"] | None = Field(
        default="b64_json", description="Only 'b64_json' (PNG bytes, base64) is served; 'url' is not.")
    output_format: Literal["png", "jpeg", "webp"] | None = Field(default=None, description="Image encoding (PNG).")
    quality: str | None = Field(default=None, description="Accepted and ignored.")
    style: str | None = Field(default=None, description="Accepted and ignored.")
    user: str | None = Field(default=None, description="Accepted and ignored.")
    seed: int | None = Field(default=None, ge=0, lt=2**63, description="Noise seed (image i uses seed + i).")
    num_inference_steps: int | None = Field(default=None, ge=1, description="Denoising steps.")
    true_cfg_scale: float | None = Field(default=None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False, description=(
        "Classifier-free guidance scale; guidance runs when > 1 and a negative_prompt is given."))
    guidance_scale: float | None = Field(default=None, ge=0, le=MAX_GUIDANCE_SCALE, allow_inf_nan=False, description=(
        "Distilled-guidance input of guidance-distilled transformers; for others an alias of true_cfg_scale."))
    negative_prompt: str | None = Field(default=None, description="What not to draw (enables true CFG).")
    cache: CacheOptions | None = Field(default=None, description="Cache acceleration overrides.")
    return_latents: bool = Field(default=False, description=(
        "omni_serve extension: add each image's final denoised latents to its data item ('latents'): the packed "
        "latents [(H/16)*(W/16), 64] after the last scheduler step, before unpacking, de-normalisation and the VAE "
        "decode, i.e. what diffusers' QwenImagePipeline returns with output_type='latent' (one image's row), as "
        "base64 little-endian float32 with their shape."))

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("prompt must not be empty")
        return value

    @field_validator("size")
    @classmethod
    def _size_format(cls, value: str | None) -> str | None:
        if value is None or value == "auto":
            return value
        if not _SIZE.match(value):
            raise ValueError("size must be 'WIDTHxHEIGHT' (e.g. '256x256') or 'auto'")
        return value

    @field_validator("response_format", mode="before")
    @classmethod
    def _response_format(cls, value):
        if value == "url":
            raise ValueError("response_format 'url' is not supported; use 'b64_json'")
        return value

    def dimensions(self, default: tuple[int, int]) -> tuple[int, int]:
        """(width, height) asked for, or ``default``."""
        if self.size is None or self.size == "auto":
            return default
        w, h = _SIZE.match(self.size).groups()
        return int(w), int(h)


class ImageLatents(BaseModel):
    """One image's final latents (``return_latents``)."""

    data: str = Field(description="The latents' bytes, base64: little-endian float32, row-major.")
    shape: list[int] = Field(description="Their shape: [image tokens, channels], the packed 2x2 latent patches.")
    dtype: Literal["float32"] = Field(default="float32", description="Element type of data.")


class ImageData(BaseModel):
    b64_json: str = Field(description="The encoded image, base64.")
    revised_prompt: str | None = Field(default=None, description="Unused (prompts are not rewritten).")
    latents: ImageLatents | None = Field(default=None, description=(
        "omni_serve extension (return_latents): the latents this image was decoded from."))


class ImageMetrics(BaseModel):
    num_inference_steps: int = Field(description="Denoising steps per image.")
    computed_steps: list[int] = Field(description="Per image: steps whose transformer forward ran fully.")
    cached_steps: list[int] = Field(description="Per image: steps served (partly) from the cache.")
    cache_mode: str = Field(description="Cache acceleration used ('off', 'dbcache', 'taylorseer').")
    true_cfg: bool = Field(description="Whether classifier-free guidance ran.")


class ImageUsage(BaseModel):
    input_tokens: int
    output_tokens: int = 0
    total_tokens: int


class ImageGenerationResponse(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))
    data: list[ImageData]
    usage: ImageUsage | None = None
    metrics: ImageMetrics | None = Field(default=None, description="omni_serve extension.")
