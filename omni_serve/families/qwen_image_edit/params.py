"""Per-stage settings of the Qwen-Image-Edit graph: the diffusion kit's, plus the VAE encoder's."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.kits.diffusion.params import (  # noqa: F401 - this graph's sections, importable from here
    CacheSpec, DiTParams, DiTStage, TextEncoderParams, TextEncoderStage, VAEParams, VAEStage,
)
from omni_serve.graph.spec import StageSpec


class VAEEncoderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(4, ge=1, description="Input images of one conditioning size encoded in one VAE call.")


class VAEEncoderStage(StageSpec):
    params: VAEEncoderParams = Field(default_factory=VAEEncoderParams, description="VAE encoder settings.")
