"""Per-stage settings of the Omni kit's stages (the ``params`` of each stage's spec section): the encoder and the
thinker (aggregated, prefill, decode). A family adds its talker and code2wav sections."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.graph.spec import StageSpec


class ThinkerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    default_max_tokens: int = Field(256, ge=1, description="Text tokens generated when a request sets no limit.")
    max_model_len: int | None = Field(None, ge=16, description="Prompt + output token limit; default: the model's.")
    default_temperature: float = Field(1.0, ge=0, le=2, description="Temperature when the request sets none.")


class EncoderStage(StageSpec):
    pass


class ThinkerStage(StageSpec):
    params: ThinkerParams = Field(default_factory=ThinkerParams, description="Thinker settings.")


class ThinkerPrefillStage(StageSpec):
    pass
