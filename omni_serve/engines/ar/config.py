"""Settings of the autoregressive engine (continuous batching + paged KV cache), one per AR stage."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ARConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_kv_blocks: int = Field(512, ge=2, description=(
        "KV cache capacity of a replica in blocks; the cache is allocated once at start "
        "(bytes = blocks x block_size x layers x 2 x kv_heads x head_dim x dtype size)."))
    block_size: int = Field(16, ge=1, description="Tokens per KV block (the paging and prefix-sharing unit).")
    max_batch_tokens: int = Field(256, ge=1, description=(
        "Tokens one batched forward may compute; longer prompts are prefilled in chunks of the remaining "
        "budget so decoding requests keep stepping (chunked prefill)."))
    max_num_seqs: int = Field(64, ge=1, description="Requests decoding together at most; more wait in a FIFO queue.")
    decode_kv_copy_mib: int = Field(256, ge=0, description=(
        "Memory for a contiguous copy of the decoding requests' keys/values, kept from step to step so each "
        "layer appends one token instead of gathering every request's KV from the paged cache; used when the "
        "batch's copy fits (bytes = requests x tokens rounded up to 128 x layers x 2 x kv_heads x head_dim x "
        "dtype size), else decode gathers as before. 0 disables it. Results are identical either way."))
    packed_linear: bool = Field(True, description=(
        "Run the model's linear layers on weights prepacked once for oneDNN (CPU, float32/bfloat16; "
        "omni_kernels.pack_linears): 1.1-2.2x faster matrix products at decode batch sizes, outputs equal to "
        "float rounding. Other devices and dtypes are left as they are, and so are bfloat16 layers on CPUs "
        "without oneDNN's bfloat16 product (AVX2-only; the replica logs it, /health shows it under kernels)."))
    prepared_layers: bool = Field(True, description=(
        "Run the decoder's layers on prepared weights (omni_serve.models.prepared_decoder.PreparedDecoder: fused "
        "q/k/v and gate/up products over the paged KV cache) where the stage's adapter has them (the Qwen2.5-Omni "
        "thinker and talker, the Qwen3-ASR LLM, the VibeVoice LM); false, or layers it does not reproduce, runs "
        "transformers' own layer forward. See docs/prepared.md."))
    gemv_max_rows: int = Field(2, ge=0, description=(
        "With packed_linear, steps of at most this many rows run float32 projections as MKL matrix-vector "
        "products on a second, row-major copy of each weight (1.4-1.7x faster than the packed product at 1-2 "
        "rows on this CPU, benchmarks/tools/kernels_bench.py: a concurrency-1 decode step; slower from 4 rows on). "
        "Costs one more copy of the float32 linear weights; 0 keeps only the packed copy. Ignored in bfloat16, "
        "where packing always wins."))
    enable_prefix_caching: bool = Field(True, description=(
        "Reuse KV blocks of identical prompt prefixes (full blocks, matched by content hash)."))
