"""Per-stage settings of the Wan image-to-video graph: the diffusion kit's, plus its two image encoders'."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.graph.spec import StageSpec


class ImageEncoderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(16, ge=1, description="First frames encoded by the CLIP vision tower in one call.")


class FirstFrameEncoderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(2, ge=1, description=(
        "First frames of one size and frame count encoded in one VAE call (each with the black frames after it)."))


class ImageEncoderStage(StageSpec):
    params: ImageEncoderParams = Field(default_factory=ImageEncoderParams, description="Image encoder settings.")


class FirstFrameEncoderStage(StageSpec):
    params: FirstFrameEncoderParams = Field(default_factory=FirstFrameEncoderParams, description=(
        "First-frame VAE encoder settings."))
