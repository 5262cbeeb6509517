"""Per-stage settings of the Qwen2.5-Omni graph (the ``params`` of each stage's spec section): the Omni kit's
encoder and thinker sections, and this family's talker and code2wav."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.graph.spec import StageSpec
from omni_serve.kits.omni.params import (  # noqa: F401 - the encoder and thinker sections, importable from here
    EncoderStage, ThinkerParams, ThinkerPrefillStage, ThinkerStage,
)


class TalkerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_codec_tokens: int = Field(1024, ge=1, description="Codec tokens per response at most (50 per second of audio).")
    temperature: float = Field(0.9, ge=0, description="Codec sampling temperature (0: greedy). Requests with temperature 0 decode greedily.")
    top_k: int = Field(40, ge=0, description="Codec top-k (0: off).")
    top_p: float = Field(0.8, gt=0, le=1, description="Codec top-p.")
    repetition_penalty: float = Field(1.05, gt=0, description="Codec repetition penalty (as transformers' generate).")


class Code2WavParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_steps: int = Field(10, ge=1, le=64, description="Flow-matching ODE steps of the DiT.")
    guidance_scale: float = Field(0.5, ge=0, description="Classifier-free guidance scale of the DiT.")
    sway_coefficient: float = Field(-1.0, description="Sway sampling coefficient of the ODE time grid.")
    first_chunk_codes: int = Field(12, ge=1, description=(
        "Codec tokens in the first synthesized audio chunk (small = early first audio). Chunk sizes and "
        "contexts are multiples of the DiT block (block_size / repeats codes: 12 for Qwen2.5-Omni)."))
    chunk_codes: int = Field(96, ge=1, description="Codec tokens per later audio chunk (the largest chunk).")
    chunk_growth: float = Field(2.0, ge=0, description=(
        "Each later chunk is at most this many times the codes already sent (rounded down to the DiT block), up "
        "to chunk_codes; 0: every later chunk is chunk_codes. Chunks that grow from the first let the second one "
        "arrive before a client that started playing the first runs dry (docs/speech_under_load.md)."))
    cut_lead_s: float = Field(0.4, ge=0, description=(
        "A later chunk whose client would run dry within this many seconds goes at once, cut to the whole DiT "
        "blocks of codes the talker has sent (0: chunks are never cut). Roughly the time a window takes to "
        "compute and reach the client."))
    plan_chunks: bool = Field(True, description=(
        "Size chunks by what this machine's code2wav calls cost (the engine's cost model) and each client's "
        "buffer: the first chunk as long as the client needs to never run dry afterwards (first_chunk_codes where "
        "the machine is fast enough), a later chunk no longer than lands before its client runs dry. false: the "
        "sizes above alone. See docs/speech_under_load.md."))
    plan_margin: float = Field(0.3, ge=0, description=(
        "plan_chunks assumes calls take this fraction longer than the cost model estimates (noise, other "
        "streams' windows in the same call)."))
    left_context_codes: int = Field(12, ge=0, description="Codes before a chunk the DiT sees (seam accuracy).")
    right_context_codes: int = Field(12, ge=0, description=(
        "Codes after a chunk the DiT sees; a chunk waits for them (or the end of speech)."))
    vocoder_context_frames: int = Field(8, ge=0, description="Mel frames of context on each side of a vocoder chunk.")
    max_batch: int = Field(16, ge=1, description=(
        "Windows of different requests solved in one DiT call (any lengths: packed end to end)."))
    dit_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description=(
        "dtype of the DiT's transformer blocks. auto (the default): bfloat16 where this machine runs it faster "
        "than float32 (a CPU with AVX512-BF16 or AMX and oneDNN's bfloat16 product), else float32; the replica "
        "logs the choice and /health shows it under kernels (code2wav.dit_dtype). float32 is transformers' "
        "token2wav, which the oracle holds the stage to. bfloat16 runs the blocks on a bfloat16 copy (ODE state, "
        "solver, input and output layers stay float32): with AVX512-BF16 the DiT is ~1.4x faster, with AMX ~2.4x, "
        "the mel within ~7e-4 of float32's (relative max; benchmarks/qwen2_5_omni/code2wav_cost.py). On CPUs "
        "without oneDNN's bfloat16 product (AVX2-only) the blocks run on plain bfloat16 layers: the same answer, "
        "several times slower than float32. GPUs: auto is float32 (bfloat16 there is not measured yet)."))
    prepared_dit: bool = Field(True, description=(
        "Run the DiT's blocks prepared (omni_serve.models.qwen2_5_omni_dit.PreparedDiT: fused, prepacked, "
        "block-local attention; less work per ODE step, measured in docs/prepared.md). false, or a DiT it does not "
        "reproduce, runs transformers' DiTDecoderLayer window by window in float32 (dit_dtype then does not "
        "apply); /health shows the path under kernels. See docs/prepared.md."))
    prepared_vocoder: bool = Field(True, description=(
        "Run the vocoder with prepared anti-aliased activations (PreparedBigVGAN: the module's forward to float "
        "rounding, cheaper). false, or a vocoder it does not reproduce, runs transformers' own forward."))


class TalkerStage(StageSpec):
    params: TalkerParams = Field(default_factory=TalkerParams, description="Talker settings.")

    parallel_kinds = ("tensor",)  # its layers split across ranks, as the thinker's (the talker is always native)


class Code2WavStage(StageSpec):
    params: Code2WavParams = Field(default_factory=Code2WavParams, description="code2wav settings.")


class TensorParallelThinkerStage(ThinkerStage):
    """The aggregated thinker: on the native engine its layers may split across ranks (``parallel.tensor``)."""

    parallel_kinds = ("tensor",)

    @model_validator(mode="after")
    def _native_only(self) -> "TensorParallelThinkerStage":
        if self.parallel.tensor > 1 and self.engine.backend != "native":
            raise ValueError("parallel.tensor is the native engine's; on vLLM set engine.vllm.tensor_parallel_size")
        return self
