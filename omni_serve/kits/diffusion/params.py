"""Per-stage settings of the diffusion stages (the ``params`` of each stage's spec section): text encoder, DiT,
VAE decoder."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.kits.diffusion.messages import CacheSettings
from omni_serve.graph.spec import StageSpec


class TextEncoderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(16, ge=1, description="Prompts of equal token length encoded in one forward.")


class CacheSpec(BaseModel):
    """cache-dit settings of the DiT stage (see docs/qwen_image.md)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["off", "dbcache", "taylorseer"] = Field("off", description=(
        "Default cache acceleration: 'off', 'dbcache' (cache-dit DBCache) or 'taylorseer' "
        "(DBCache + TaylorSeer calibrator)."))
    fn_compute_blocks: int = Field(1, ge=1, description="DBCache Fn: leading blocks always computed (the probe).")
    bn_compute_blocks: int = Field(0, ge=0, description="DBCache Bn: trailing blocks always computed.")
    residual_diff_threshold: float = Field(0.08, gt=0, description=(
        "Relative change of the probe's residual below which a step reuses the cached residual."))
    max_warmup_steps: int = Field(2, ge=0, description="Steps always computed at the start of a request.")
    max_cached_steps: int = Field(-1, ge=-1, description="Most cached steps per request (-1: no limit).")
    max_continuous_cached_steps: int = Field(-1, ge=-1, description="Most cached steps in a row (-1: no limit).")
    taylorseer_order: int = Field(1, ge=1, le=4, description="TaylorSeer expansion order (taylorseer mode).")
    allow_request_override: bool = Field(True, description="Requests may pick the mode and threshold.")
    max_request_threshold: float = Field(0.5, gt=0, description="Largest residual_diff_threshold a request may ask.")

    def settings(self) -> CacheSettings:
        """What the DiT stage needs to set up caching (a request may override some), without the limits."""
        return CacheSettings(**self.model_dump(exclude={"allow_request_override", "max_request_threshold"}))


class DiTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(8, ge=1, description=(
        "Requests whose step shares one transformer forward (CFG adds a row per image)."))
    cache: CacheSpec = Field(default_factory=CacheSpec, description="Cache acceleration (cache-dit).")
    packed_linear: bool = Field(True, description=(
        "Run the transformer's linear layers on weights prepacked once for oneDNN (CPU, float32/bfloat16; "
        "omni_kernels.pack_linears): ~10% faster forward in float32 and ~20% in bfloat16 on a 2-core CPU, outputs "
        "equal to float rounding. bfloat16 layers stay plain on CPUs without oneDNN's bfloat16 product (AVX2-only; "
        "logged, and shown in /health under kernels)."))
    packed_forward: bool = Field(True, description=(
        "Run the transformer through omni_serve's packed forward (omni_serve.models.qwen_image_packed: rows of "
        "different prompt lengths and grids in one forward without padding) where it covers the transformer's "
        "variant; false, or a variant it does not cover, runs diffusers' padded forward. See docs/prepared.md."))


class VAEParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(8, ge=1, description="Same-size requests decoded in one VAE call.")
    tile_min_pixels: int | None = Field(512, ge=64, description=(
        "Images with a side above this many pixels decode in tiles (bounded memory); None: never tile."))
    tile_stride_pixels: int | None = Field(None, ge=32, description="Tile stride (default: 3/4 of the tile).")


class TextEncoderStage(StageSpec):
    params: TextEncoderParams = Field(default_factory=TextEncoderParams, description="Text encoder settings.")


class DiTStage(StageSpec):
    params: DiTParams = Field(default_factory=DiTParams, description="Denoising loop settings.")

    # a step's rows split across the replica's ranks, or every row's image tokens (omni_serve.graph.ranks)
    parallel_kinds = ("rows", "sequence")


class VAEStage(StageSpec):
    params: VAEParams = Field(default_factory=VAEParams, description="VAE decoder settings.")


class VideoDiTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(4, ge=1, description=(
        "Rows (videos, and their unconditional twins under guidance) of one latent shape in one forward, "
        "whatever step each request is at."))


class VideoVAEParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(2, ge=1, description="Videos of one latent shape decoded in one VAE call.")
    tile_min_pixels: int | None = Field(None, ge=64, description=(
        "Videos with a side above this many pixels decode in spatial tiles, blended at their seams (bounded memory "
        "at large sizes; frames then differ slightly from an untiled decode). None: never tile. The decode is "
        "already chunked in time: one latent frame at a time, with the VAE's causal cache."))
    tile_stride_pixels: int | None = Field(None, ge=32, description="Tile stride (default: 3/4 of the tile).")


class VideoDiTStage(StageSpec):
    params: VideoDiTParams = Field(default_factory=VideoDiTParams, description="Denoising loop settings.")


class VideoVAEStage(StageSpec):
    params: VideoVAEParams = Field(default_factory=VideoVAEParams, description="VAE decoder settings.")
