"""vLLM's ``AsyncLLM`` behind omni_serve's engine contract (``omni_serve.engines.base.Engine``).

Contract: ``VllmEngine(name, checkpoint, settings, dtype, device, threads, tap=...)``; ``await start()`` once
(idempotent: builds the engine, ~25 s on CPU with ``enforce_eager``, and installs the hidden-state tap);
``generate(request_id, VllmRequest(prompt, params))`` yields vLLM's ``RequestOutput`` deltas for one request (a
request that wants its hidden states registers for them first with ``tap_rows(request_id)``); it takes no streamed
``inputs``. ``abort(request_id)`` stops it in vLLM and frees its KV blocks (its ``generate`` raises);
``drain(deadline_s)`` and admission (``max_active``) are ``omni_serve.engines.admission.AdmittingEngine``'s;
``cleanup()`` shuts vLLM down (idempotent). The request's id in vLLM is ours (vLLM appends a random suffix
internally).

Load signals (``load()``, the native engines' formula and keys, for autoscaling and metrics): vLLM reports its
scheduler's state after every step to ``_StepStats`` (a vLLM stat logger): running and waiting requests and
KV-cache use; ``utilization`` is the busy fraction of the engine (time with requests running), ``backlog`` the
waiting requests in units of ``max_num_seqs``, ``queued`` the requests waiting for admission here.

vLLM runs in its own processes (engine core and worker, ~3 GiB on CPU); its settings come from the stage's
``engine.vllm`` section (``VllmSettings``) and never from literals here. Only the replica imports this module (it
imports vLLM).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from omni_serve.engines.admission import AdmittingEngine
from omni_serve.engines.vllm_engine import compat
from omni_serve.engines.vllm_engine.config import VllmSettings
from omni_serve.engines.vllm_engine.tap import TAP_METHOD, TapReceiver, TapRows

if TYPE_CHECKING:
    from omni_serve.engines.registry import EngineSite

log = logging.getLogger(__name__)


def _stat_logger_factory(engine: "VllmEngine"):
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _StepStats(StatLoggerBase):
        """Feeds each step's scheduler state to the ``VllmEngine`` (load signals, step metrics)."""

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                engine._on_scheduler_stats(scheduler_stats)
            if iteration_stats is not None:
                engine.counters["preempted"] += iteration_stats.num_preempted_reqs

        def log_engine_initialized(self):
            pass

    return _StepStats


@dataclass(frozen=True)
class VllmRequest:
    """One request's work on a vLLM stage (the ``program`` of ``VllmEngine.generate``)."""

    prompt: dict  # vLLM's prompt: prompt_token_ids, and multi_modal_data when the request has media
    params: Any  # vllm.SamplingParams; output_kind should be DELTA


class VllmEngine(AdmittingEngine):
    def __init__(self, name: str, checkpoint: str, settings: VllmSettings, *, dtype: str = "float32",
                 device: str = "cpu", threads: int = 1, max_active: int = 64, max_model_len: int | None = None,
                 tap: bool = True):
        super().__init__(name, max_active)
        self.checkpoint, self.settings = checkpoint, settings
        self.dtype, self.device, self.threads = dtype, device, threads
        self.max_model_len = settings.max_model_len or max_model_len
        self.tap = tap
        self.llm = None
        self.receiver: TapReceiver | None = None
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        self._closed = False
        self._aborted: set[str] = set()  # admitted requests aborted by abort(): their generate raises
        self.worker_pids: list[int] = []  # vLLM's worker processes, one per tensor-parallel rank (with the tap)
        self._running = self._waiting = 0
        self._kv_used = 0.0
        self._last_step = time.monotonic()
        self.counters = {"requests": 0, "aborted": 0, "preempted": 0, "steps": 0}

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def engine_args(self):
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        s = self.settings
        limits = {"image": s.max_media_per_prompt, "audio": s.max_media_per_prompt, "video": 0}
        args: dict[str, Any] = dict(
            model=self.checkpoint, dtype=self.dtype, enforce_eager=s.enforce_eager,
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=self.max_model_len, tensor_parallel_size=s.tensor_parallel_size,
            # cached prompt rows are never computed, so they would have no hidden states for the tap
            enable_prefix_caching=not self.tap, limit_mm_per_prompt=limits, disable_log_stats=False,
            async_scheduling=False,  # the tap's rows of a step belong to the tokens that step scheduled
        )
        # llguidance, the grammar engine of the native thinker's constrained decoding (omni_serve.engines.constraints),
        # compact JSON as there (vLLM's guidance backend reads the whitespace setting here, not per request): a JSON
        # response_format constrains a reply the same way on both backends
        args["structured_outputs_config"] = StructuredOutputsConfig(backend="guidance", disable_any_whitespace=True)
        if s.tensor_parallel_size > 1:
            # vLLM's own worker processes beside the replica: inside a placement group vLLM would pick its Ray
            # executor and place them itself
            args["distributed_executor_backend"] = "mp"
        if self.device != "cpu":
            args["gpu_memory_utilization"] = s.gpu_memory_utilization
        if self.tap:
            args["worker_extension_cls"] = "omni_serve.engines.vllm_engine.tap.HiddenStateTap"
        args.update(s.extra_engine_args)
        return AsyncEngineArgs(**args)

    async def start(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self._started:
                return
            if self._closed:
                raise RuntimeError(f"engine of stage {self.name} was shut down")
            version = compat.check_version()
            if self.device == "cpu":
                os.environ.update(compat.engine_env(self.settings.kv_cache_gib, self.settings.threads_bind))
                os.environ["OMP_NUM_THREADS"] = str(self.threads)  # vLLM keeps an external value (nobind)
            from vllm.v1.engine.async_llm import AsyncLLM

            t0 = time.monotonic()
            # Building the engine blocks for its start-up (processes, weights): off the event loop.
            self.llm = await asyncio.to_thread(
                AsyncLLM.from_engine_args, self.engine_args(), stat_loggers=[_stat_logger_factory(self)])
            if self.tap:
                self.receiver = TapReceiver()
                await self.receiver.start()
                self.worker_pids = list(await self.llm.collective_rpc(TAP_METHOD, args=(self.receiver.address,)))
            self._started = True
            log.info("stage %s: vLLM %s engine ready in %.1f s (tap %s)", self.name, version,
                     time.monotonic() - t0, "on" if self.tap else "off")

    def tap_rows(self, request_id: str) -> TapRows:
        if self.receiver is None:
            raise RuntimeError(f"stage {self.name}: the hidden-state tap is off")
        return self.receiver.register(request_id)

    async def generate(self, request_id: str, program: VllmRequest,
                       inputs: AsyncIterator[Any] | None = None) -> AsyncIterator:
        """vLLM's outputs of one request (see ``Engine.generate``)."""
        if inputs is not None:
            raise ValueError(f"stage {self.name}: vLLM requests take no streamed input")
        await self.start()
        if request_id in self.admission.admitted:
            raise ValueError(f"request {request_id} is already running on {self.name}")
        await self.admission.enter(request_id)
        self.counters["requests"] += 1
        finished = False
        try:
            async for out in self.llm.generate(program.prompt, program.params, request_id=request_id):
                if request_id in self._aborted:  # vLLM's last output of an aborted request: the caller gets an error
                    raise self.aborted_error(request_id)
                finished = out.finished
                yield out
            if request_id in self._aborted:
                raise self.aborted_error(request_id)
        finally:
            self._aborted.discard(request_id)
            self.admission.leave(request_id)
            if self.receiver is not None:
                self.receiver.unregister(request_id)
            if not finished:  # cancelled or failed: vLLM must free the request's KV blocks now
                self.counters["aborted"] += 1
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self.admission.admitted:
            self._aborted.add(request_id)
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def cleanup(self) -> None:
        self.admission.close()  # requests cut short by the shutdown fail with Draining, not as failures
        for request_id in list(self.admission.admitted):
            await self.abort(request_id)
        self._closed = True
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self.llm is not None:
            llm, self.llm = self.llm, None
            llm.shutdown()

    # -- load ----------------------------------------------------------------------------------------------
    def _on_scheduler_stats(self, stats) -> None:
        now = time.monotonic()
        self.counters["steps"] += 1
        if self.on_step is not None and stats.num_running_reqs and self._running:
            # a step's time is the gap between two reports while busy (after an idle gap it is unknown)
            self.on_step(stats.num_running_reqs, now - self._last_step)
        self._last_step = now
        was_busy = self._running > 0
        self._running, self._waiting = stats.num_running_reqs, stats.num_waiting_reqs
        self._kv_used = float(stats.kv_cache_usage)
        if self._running and not was_busy:
            self.busy.start()
        elif was_busy and not self._running:
            self.busy.stop()

    @property
    def alive(self) -> bool:
        return self.llm is None or not self.llm.errored

    def backlog(self) -> float:
        return self._waiting / self.settings.max_num_seqs

    def extra_load(self) -> dict[str, float]:
        return {"kv_used_fraction": self._kv_used, "running": float(self._running),
                "waiting": float(self._waiting), "ready_waiting": float(self._waiting)}

    def stats(self) -> dict:
        return {"active": self.num_active, "running": self._running, "waiting": self._waiting,
                "kv_used_fraction": self._kv_used, "backend": "vllm",
                "tensor_parallel_size": self.settings.tensor_parallel_size, "worker_pids": self.worker_pids,
                **self.counters}


def build_engine(site: "EngineSite") -> VllmEngine:
    """The ``vllm`` engine kind (``omni_serve.engines.registry``): vLLM on the spec's checkpoint with the stage's
    ``engine.vllm`` settings; ``engine_options()`` adds e.g. ``max_model_len``, ``tap``."""
    s = site.engine_spec
    return VllmEngine(site.stage.name, site.spec.checkpoint, s.vllm, dtype=s.dtype, device=s.device,
                      threads=s.torch_threads, max_active=s.max_active_requests, **site.engine_options())
