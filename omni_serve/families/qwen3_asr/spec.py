"""The Qwen3-ASR graph spec: request limits, how long audio is split into windows, decoding limits, plus the
``stages``/``edges`` sections derived from the graph declaration (overridable from Python, CLI or YAML)."""

from __future__ import annotations

from pydantic import Field, model_validator

from omni_serve.families.qwen3_asr.graph import GRAPH
from omni_serve.families.qwen3_asr.params import (  # noqa: F401 - the spec's section types, importable from here
    EncoderParams, EncoderStage, LLMParams, LLMStage,
)
from omni_serve.graph.spec import GraphSpecBase

Qwen3ASRStages = GRAPH.stages_model("Qwen3ASRStages")
Qwen3ASREdges = GRAPH.edges_model("Qwen3ASREdges")


class Qwen3ASRGraphSpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Local Qwen3-ASR checkpoint directory (transformers' -hf layout).")
    model_name: str = Field("qwen3-asr", description="Model id served at /v1/models and accepted in requests.")
    max_file_bytes: int = Field(25 * 2**20, ge=1024, description=(
        "Largest upload accepted (bytes; OpenAI's limit is 25 MB)."))
    max_audio_seconds: float = Field(1200.0, gt=0, description=(
        "Longest audio accepted (seconds), read from the decoded file."))
    window_seconds: float = Field(30.0, ge=1, description=(
        "Longest window the audio is transcribed in (the feature extractor's chunk_length). Longer audio is cut "
        "into windows at the quietest moment of the last window_search_seconds before each limit, each transcribed "
        "alone (one request on the stages each, run together) and the texts joined."))
    window_search_seconds: float = Field(5.0, ge=0, description=(
        "How far before a window's limit the cut may move to find a quiet moment (0: cut exactly at the limit)."))
    max_tokens: int = Field(512, ge=1, description=(
        "Most tokens generated per window (the original library's max_new_tokens; language prefix included)."))

    stages: Qwen3ASRStages = Field(default_factory=Qwen3ASRStages, description="One deployment per stage.")
    edges: Qwen3ASREdges = Field(default_factory=Qwen3ASREdges, description="Data-plane settings per edge.")

    @model_validator(mode="after")
    def _check(self) -> "Qwen3ASRGraphSpec":
        if self.window_search_seconds >= self.window_seconds:
            raise ValueError("window_search_seconds must be < window_seconds")
        return self
