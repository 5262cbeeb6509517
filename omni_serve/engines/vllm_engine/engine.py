"""vLLM's ``AsyncLLM`` behind omni_serve's engine lifecycle (start / generate / abort / cleanup).

Contract: ``VllmEngine(name, checkpoint, settings, dtype, device, threads, tap=...)``; ``await start()`` once
(idempotent: builds the engine, ~25 s on CPU with ``enforce_eager``, and installs the hidden-state tap);
``generate(request_id, prompt, params, rows)`` yields vLLM's ``RequestOutput`` deltas for one request (``rows``: a
``TapRows`` from ``tap_rows(request_id)`` when the request's hidden states are wanted); ``abort(request_id)``
stops it in vLLM and frees its KV blocks; ``cleanup()`` shuts vLLM down (idempotent). The request's id in vLLM is
ours (vLLM appends a random suffix internally).

Load signals (``load()``, the same keys as the native engines, for autoscaling and metrics): vLLM reports its
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
from typing import Any, AsyncIterator

from omni_serve.engines.base import Engine
from omni_serve.engines.load import BusyMeter
from omni_serve.engines.vllm_engine import compat
from omni_serve.engines.vllm_engine.config import VllmSettings
from omni_serve.engines.vllm_engine.tap import TAP_METHOD, TapReceiver, TapRows

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


class VllmEngine(Engine):
    def __init__(self, name: str, checkpoint: str, settings: VllmSettings, *, dtype: str = "float32",
                 device: str = "cpu", threads: int = 1, max_active: int = 64, max_model_len: int | None = None,
                 tap: bool = True):
        self.name, self.checkpoint, self.settings = name, checkpoint, settings
        self.dtype, self.device, self.threads = dtype, device, threads
        self.max_active = max_active
        self.max_model_len = settings.max_model_len or max_model_len
        self.tap = tap
        self.llm = None
        self.receiver: TapReceiver | None = None
        self._start_lock: asyncio.Lock | None = None
        self._started = False
        self._closed = False
        self._admission: asyncio.Semaphore | None = None
        self._queued = 0
        self._active: set[str] = set()
        self._running = self._waiting = 0
        self._kv_used = 0.0
        self._last_step = time.monotonic()
        self.busy = BusyMeter()
        self.counters = {"requests": 0, "aborted": 0, "preempted": 0, "steps": 0}
        self.on_step = None  # (requests in the step, seconds) -> None; set by the replica's metrics

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def engine_args(self):
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
                await self.llm.collective_rpc(TAP_METHOD, args=(self.receiver.address,))
            self._admission = asyncio.Semaphore(self.max_active)
            self._started = True
            log.info("stage %s: vLLM %s engine ready in %.1f s (tap %s)", self.name, version,
                     time.monotonic() - t0, "on" if self.tap else "off")

    def tap_rows(self, request_id: str) -> TapRows:
        if self.receiver is None:
            raise RuntimeError(f"stage {self.name}: the hidden-state tap is off")
        return self.receiver.register(request_id)

    async def generate(self, request_id: str, prompt: dict, params) -> AsyncIterator:
        """vLLM's outputs of one request (``params.output_kind`` should be DELTA)."""
        await self.start()
        self._queued += 1
        try:
            await self._admission.acquire()
        finally:
            self._queued -= 1
        self._active.add(request_id)
        self.counters["requests"] += 1
        finished = False
        try:
            async for out in self.llm.generate(prompt, params, request_id=request_id):
                finished = out.finished
                yield out
        finally:
            self._active.discard(request_id)
            self._admission.release()
            if self.receiver is not None:
                self.receiver.unregister(request_id)
            if not finished:  # cancelled or failed: vLLM must free the request's KV blocks now
                self.counters["aborted"] += 1
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        if self.llm is not None:
            await self.llm.abort(request_id)

    async def cleanup(self) -> None:
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
    def num_active(self) -> int:
        return len(self._active)

    @property
    def alive(self) -> bool:
        return self.llm is None or not self.llm.errored

    def load(self) -> dict[str, float]:
        utilization = self.busy.value()
        backlog = self._waiting / self.settings.max_num_seqs
        return {"load": utilization + backlog + self._queued / self.max_active, "utilization": utilization,
                "backlog": backlog, "queued": float(self._queued), "active": float(self.num_active),
                "kv_used_fraction": self._kv_used, "running": float(self._running),
                "waiting": float(self._waiting), "ready_waiting": float(self._waiting)}

    def stats(self) -> dict:
        return {"active": self.num_active, "running": self._running, "waiting": self._waiting,
                "kv_used_fraction": self._kv_used, "backend": "vllm", **self.counters}

