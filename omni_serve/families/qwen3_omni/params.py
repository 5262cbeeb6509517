"""Per-stage settings of the Qwen3-Omni graph (the ``params`` of each stage's spec section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.kits.omni.params import (  # noqa: F401 - the same thinker and encoder sections
    EncoderStage, ThinkerParams, ThinkerPrefillStage, ThinkerStage,
)
from omni_serve.graph.spec import StageSpec


class TalkerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_codec_tokens: int = Field(1024, ge=2, description=(
        "Talker steps per response at most; a response speaks one codec frame (80 ms) per step but the last."))
    temperature: float = Field(0.9, ge=0, description=(
        "First-codebook sampling temperature (0: greedy). Requests with temperature 0 decode greedily."))
    top_k: int = Field(50, ge=0, description="First-codebook top-k (0: off).")
    top_p: float = Field(1.0, gt=0, le=1, description="First-codebook top-p.")
    repetition_penalty: float = Field(1.05, gt=0, description="First-codebook repetition penalty (as generate).")
    predictor_top_k: int = Field(50, ge=0, description="Residual-codebook top-k when sampling (generate's).")
    predictor_top_p: float = Field(0.8, gt=0, le=1, description="Residual-codebook top-p when sampling.")


class Code2WavParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    first_chunk_codes: int = Field(2, ge=1, description=(
        "Codec frames in the first audio chunk (160 ms of audio: early first audio; chunks then grow)."))
    chunk_codes: int = Field(25, ge=1, description=(
        "Most codec frames per later chunk (chunks grow threefold up to it; 25 frames = 2 s of audio)."))
    block_codes: int = Field(300, ge=1, description=(
        "Frames decoded from one attention context, as transformers' chunked_decode(chunk_size) which generate "
        "uses: the served audio equals generate's."))
    block_left_context: int = Field(25, ge=0, description="Frames of context before each block after the first "
                                    "(chunked_decode's left_context_size).")
    cut_lead_s: float = Field(0.4, ge=0, description=(
        "A later chunk whose client would run dry within this many seconds goes at once with the frames the talker "
        "has sent (the vocoder decodes frame by frame: exact at any size; 0: chunks are never cut). "
        "See docs/speech_under_load.md."))
    max_batch: int = Field(16, ge=1, description="Requests' chunks decoded per engine call (one after another).")


class TalkerStage(StageSpec):
    params: TalkerParams = Field(default_factory=TalkerParams, description="Talker settings.")

    parallel_kinds = ("expert",)  # a mixture of experts too: its experts split across ranks, as the thinker's


class Code2WavStage(StageSpec):
    params: Code2WavParams = Field(default_factory=Code2WavParams, description="code2wav settings.")


class ExpertParallelThinkerStage(ThinkerStage):
    """The aggregated thinker (a mixture of experts): its MoE layers' experts may split across ranks
    (``parallel.expert``)."""

    parallel_kinds = ("expert",)
