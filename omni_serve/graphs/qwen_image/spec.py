"""The Qwen-Image graph spec: stages, edges, request limits and defaults (overridable from Python, CLI or YAML)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.graphs.spec import EdgeSpec, EngineSpec, GraphSpecBase, IngressSpec, SpecModel, StageSpec
from omni_serve.transport.config import DataPlaneSpec


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

    def settings(self) -> dict:
        """What the DiT stage needs to set up caching (a request may override some), without the limits."""
        return self.model_dump(exclude={"allow_request_override", "max_request_threshold"})


class DiTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(8, ge=1, description=(
        "Requests whose step shares one transformer forward (CFG adds a row per image)."))
    cache: CacheSpec = Field(default_factory=CacheSpec, description="Cache acceleration (cache-dit).")


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


class VAEStage(StageSpec):
    params: VAEParams = Field(default_factory=VAEParams, description="VAE decoder settings.")


class QwenImageStages(SpecModel):

    text_encoder: TextEncoderStage = Field(default_factory=lambda: TextEncoderStage(num_cpus=0.25),
                                           description="Prompt -> embeddings (Qwen2.5-VL).")
    dit: DiTStage = Field(default_factory=lambda: DiTStage(num_cpus=1.0, engine=EngineSpec(torch_threads=2)),
                          description="Denoising loop (QwenImageTransformer2DModel), step-level batching.")
    vae: VAEStage = Field(default_factory=lambda: VAEStage(num_cpus=0.25), description="Latents -> pixels.")


class QwenImageEdges(SpecModel):

    text_encoder_dit: EdgeSpec = Field(default_factory=EdgeSpec, description="Prompt embeddings to the DiT.")
    dit_vae: EdgeSpec = Field(default_factory=EdgeSpec, description="Final latents to the VAE.")


class QwenImageGraphSpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Local Qwen-Image checkpoint directory (diffusers layout).")
    model_name: str = Field("qwen-image", description="Model id served at /v1/models and accepted in requests.")
    default_size: str = Field("256x256", description="Image size when a request gives none ('WIDTHxHEIGHT').")
    max_side: int = Field(2048, ge=16, description="Largest width or height accepted (pixels).")
    max_pixels: int = Field(2048 * 2048, ge=256, description="Largest width x height accepted.")
    max_images: int = Field(4, ge=1, le=16, description="Most images per request (n).")
    default_steps: int = Field(20, ge=1, description="Denoising steps when a request gives none.")
    max_steps: int = Field(100, ge=1, description="Most denoising steps a request may ask for.")
    default_true_cfg_scale: float = Field(4.0, ge=0, description=(
        "CFG scale when a request gives a negative_prompt but no scale (as diffusers' default)."))
    default_guidance_scale: float = Field(1.0, ge=0, description="Distilled guidance (guidance-distilled models only).")
    data_timeout_s: float = Field(60.0, gt=0, description="How long a stage waits for an upstream payload.")
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="HTTP ingress deployment.")
    stages: QwenImageStages = Field(default_factory=QwenImageStages, description="One deployment per stage.")
    edges: QwenImageEdges = Field(default_factory=QwenImageEdges, description="Data-plane settings per edge.")
    data_plane: DataPlaneSpec = Field(default_factory=DataPlaneSpec, description=(
        "Settings of the data-plane backends the edges use (shared memory, Mooncake)."))

    @model_validator(mode="after")
    def _check(self) -> "QwenImageGraphSpec":
        if self.default_steps > self.max_steps:
            raise ValueError("default_steps must be <= max_steps")
        parts = self.default_size.split("x")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError("default_size must be 'WIDTHxHEIGHT'")
        return self

    def default_dimensions(self) -> tuple[int, int]:
        w, h = self.default_size.split("x")
        return int(w), int(h)
