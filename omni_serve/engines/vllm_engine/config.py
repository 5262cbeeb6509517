"""Settings of a stage running on vLLM (``engine.backend: vllm``), importable without vLLM installed."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

VLLM_PYTHON_ENV = "OMNI_SERVE_VLLM_PYTHON"  # the vLLM environment's interpreter when the spec names none


class VllmSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    python: str | None = Field(None, description=(
        "Interpreter of the vLLM environment the stage's replicas run in (Ray runtime_env py_executable), e.g. "
        "/app/.venv-vllm/bin/python; `make vllm-env` builds .venv-vllm. Default: $OMNI_SERVE_VLLM_PYTHON, "
        "else the serving interpreter (vLLM installed beside omni_serve, e.g. a GPU image)."))
    kv_cache_gib: float = Field(1.0, gt=0, description=(
        "KV cache of the engine in GiB (VLLM_CPU_KVCACHE_SPACE on CPU; on GPU vLLM sizes it from "
        "gpu_memory_utilization)."))
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Fraction of GPU memory vLLM may use (GPU).")
    threads_bind: str = Field("nobind", description=(
        "VLLM_CPU_OMP_THREADS_BIND: 'nobind' (default; the replica's torch_threads threads, unpinned), 'auto' "
        "(vLLM pins cores from 0: two engines on one machine would share them) or a core list such as '0-1'."))
    max_num_seqs: int = Field(64, ge=1, description="Requests vLLM decodes together at most.")
    max_num_batched_tokens: int = Field(2048, ge=16, description="Tokens one vLLM step may compute (chunked prefill).")
    max_model_len: int | None = Field(None, ge=16, description="Prompt + output limit (default: the thinker's params, "
                                                                "else the model's).")
    enforce_eager: bool = Field(True, description=(
        "Skip torch.compile / CUDA graphs: starts in ~25 s instead of minutes on CPU. Set false on GPU for speed."))
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "Tensor-parallel ranks of one replica: vLLM's own worker processes (its multiprocessing executor), one per "
        "rank, on the replica's node; on CPU each runs the stage's torch_threads threads over gloo, so give the "
        "stage num_cpus for all of them. The hidden-state tap runs on every rank and rank 0 sends."))
    max_media_per_prompt: int = Field(16, ge=0, description="Images and audio clips per prompt vLLM budgets for.")
    extra_engine_args: dict = Field(default_factory=dict, description=(
        "Further vllm AsyncEngineArgs fields passed as is (e.g. quantization, kv_cache_dtype)."))
