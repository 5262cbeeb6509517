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

    stream_interval: int = Field(4, ge=1, description=(
        "Tokens per message the LLM sends the ingress while a window of a streamed transcription (stream=true, a "
        "realtime session) decodes: its first token at once (time to first text), then groups of this many, the "
        "rest when it ends; a transcription that does not stream gets each window's tokens in one message. 1 sends "
        "every token as it is chosen; larger values cut the messages and SSE events per transcript (CPU in the "
        "replica, Ray, the ingress and the proxy: at concurrency 8 on 2 cores as much as the model's) for text in "
        "bigger steps. The tokens, and so the text, are the same."))


class EncoderStage(StageSpec):
    params: EncoderParams = Field(default_factory=EncoderParams, description="Audio encoder settings.")


class LLMStage(StageSpec):
    params: LLMParams = Field(default_factory=LLMParams, description=(
        "LLM settings (how its tokens are sent; the engine's: engine.ar)."))
