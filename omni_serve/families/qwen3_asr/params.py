"""Per-stage settings of the Qwen3-ASR graph (the ``params`` of each stage's spec section). The LLM's engine
settings (KV cache, batch) are its ``engine.ar``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.graph.spec import StageSpec


class EncoderParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(16, ge=1, description=(
        "Audio windows (of any requests and lengths) encoded in one call; each keeps its own features, zero-padded "
        "to the longest in mel space, so its embeddings are those it gets alone."))


class LLMParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EncoderStage(StageSpec):
    params: EncoderParams = Field(default_factory=EncoderParams, description="Audio encoder settings.")


class LLMStage(StageSpec):
    params: LLMParams = Field(default_factory=LLMParams, description="LLM settings (none yet: see engine.ar).")
