"""Batch engine for one-shot stages (code2wav, later VAE/encoders): compatible steps of many requests run as one call.

Contract (request lifecycle as ``omni_serve.engines.loop.LoopEngine``): programs are ``BatchProgram``s.
Each tick the worker picks the ready programs to compute now (``omni_serve.engines.deadlines``: all of them, unless
programs have a ``deadline()``; then those the deadlines say, most urgent first, the rest in a later tick) and
asks each for its next unit of work, ``work() -> (key, payload)``; payloads with equal ``key`` are computed together
by the engine's ``compute(payloads) -> results`` (at most ``max_batch`` per call), then each program gets its result
through ``complete(result) -> outputs``. Groups run by their earliest deadline, then in ascending key order
(Qwen2.5-Omni's code2wav keys a request's first window 0 and later windows 1, so a first chunk is not queued behind
other requests' long windows). ``work()`` is only called for a unit that is computed in the same tick. ``compute``
runs without any request lock, so feeding and aborts never wait for a batch; an aborted request's result is
dropped. Each call is timed into the engine's ``CostModel`` (by the programs' ``work_size()``), which the deadline
choice reads. A tick's units are shortened (``limit``) to end before the deadlines of the work left out of it, ready or
not (``deadlines.call_budget``): programs that can shorten a unit say how far (``least_size()``).
"""

from __future__ import annotations

import abc
import logging
import math
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Hashable

from omni_serve.engines.base import StageProgram
from omni_serve.engines.deadlines import CostModel, Ready, call_budget, choose_by_deadline, fit_to_budget
from omni_serve.engines.load import DecayingMean
from omni_serve.engines.loop import LoopEngine, Slot, log_failure

if TYPE_CHECKING:
    from omni_serve.engines.registry import EngineSite

log = logging.getLogger(__name__)


class BatchProgram(StageProgram):
    @abc.abstractmethod
    def work(self) -> tuple[Hashable, Any]:
        """The next unit of work (only called when ``ready()``): a grouping key and the payload."""

    @abc.abstractmethod
    def complete(self, result: Any) -> list[Any]:
        """Take the computed result of the last ``work()``; return outputs for the caller."""

    def deadline(self) -> float | None:
        """When the next unit's output is due (``time.monotonic()``); None: no deadline (the default)."""
        return None

    def work_size(self) -> float:
        """The next unit's share of a call's cost, in the engine's units (e.g. frames); 1 by default."""
        return 1.0

    def least_size(self) -> float | None:
        """The smallest the next unit can be shortened to (``limit``); None (the default): it cannot be."""
        return None

    def limit(self, size: float) -> None:
        """Make the next unit (the next ``work()``) at most ``size`` (no less than ``least_size()``); a program
        whose units cannot be shortened ignores it (the default)."""

    def step(self) -> list[Any]:
        raise RuntimeError("batch programs are stepped by omni_serve.engines.batch.BatchEngine")


class BatchEngine(LoopEngine):
    def __init__(self, name: str, compute: Callable[[list[Any]], list[Any]], max_batch: int = 16,
                 max_active: int = 64, torch_threads: int | None = None, work_unit: str | None = None):
        super().__init__(name, max_active=max_active, torch_threads=torch_threads)
        self.compute = compute
        self.max_batch = max_batch
        # compute_s is wall time inside ``compute``; compute_cpu_s the worker thread's CPU time there (less than
        # compute_s when other processes preempt it on a busy machine)
        self.counters = {"calls": 0, "items": 0, "compute_s": 0.0, "compute_cpu_s": 0.0}
        # ``work_unit`` names what programs' ``work_left()`` counts (e.g. "diffusion_steps"): load() then
        # reports "<work_unit>_in_flight", the units every live request still needs.
        self.work_unit = work_unit
        self._occupancy = DecayingMean()  # items per call / max_batch
        self._ready = 0  # items ready at the last tick
        self._deferred = 0  # of them, left for a later tick by their deadlines
        self._work_left = 0.0
        self.cost = CostModel()

    def backlog(self) -> float:
        """Items ready beyond one full batch, in full batches."""
        return max(0, self._ready - self.max_batch) / self.max_batch

    def extra_load(self) -> dict[str, float]:
        out = {"batch_occupancy": self._occupancy.value(), "ready": float(self._ready),
               "ready_waiting": float(max(self._deferred, self._ready - self.max_batch))}
        if self.work_unit:
            out[f"{self.work_unit}_in_flight"] = self._work_left
        return out

    def stats(self) -> dict:
        return {**super().stats(), **self.counters}

    def tick(self) -> bool:
        ready: list[Ready] = []
        waiting: list[Ready] = []  # live work with a deadline that is not ready (its input is still coming)
        work_left = 0.0
        for slot in self.live_slots():
            with slot.lock:
                program = slot.program
                if self.work_unit:
                    work_left += program.work_left() or 0
                is_ready, deadline = program.ready(), program.deadline()
                if is_ready or deadline is not None:
                    item = Ready(slot, deadline, program.work_size(), program.least_size())
                    (ready if is_ready else waiting).append(item)
        now = time.monotonic()
        chosen = choose_by_deadline(ready, now, self.cost)
        picked = {id(r) for r in chosen}
        # the units are cut to one call's budget; a tick whose units fall in two groups (keys) pays a second fixed
        # cost that the budget does not count
        budget = call_budget(waiting + [r for r in ready if id(r) not in picked], now, self.cost)
        fitted = fit_to_budget(chosen, budget)
        self._ready, self._deferred, self._work_left = len(ready), len(ready) - len(fitted), work_left
        groups: dict[Hashable, list[tuple[Slot, Any, float]]] = defaultdict(list)
        due: dict[Hashable, float] = {}
        for r, limit in fitted:
            slot = r.item
            with slot.lock:
                if slot.aborted or slot.finished or not slot.program.ready():
                    continue
                try:
                    size = r.size
                    if limit is not None:
                        slot.program.limit(limit)
                        size = slot.program.work_size()
                    key, payload = slot.program.work()
                except Exception as exc:  # noqa: BLE001 - reported to the request's caller
                    log_failure(log, exc, "%s: request %s failed", self.name, slot.request_id)
                    self.finish(slot, exc)
                    continue
            groups[key].append((slot, payload, size))
            due[key] = min(due.get(key, math.inf), math.inf if r.deadline is None else r.deadline)
        for key, items in sorted(groups.items(), key=lambda kv: (due[kv[0]], kv[0])):
            for i in range(0, len(items), self.max_batch):
                self._occupancy.add(len(items[i:i + self.max_batch]) / self.max_batch)
                self._compute_group(items[i:i + self.max_batch])
        return bool(groups)

    def _compute_group(self, items: list[tuple[Slot, Any, float]]) -> None:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            results = self.compute([payload for _, payload, _ in items])
        except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the replica
            log_failure(log, exc, "%s: batch of %d failed", self.name, len(items))
            for slot, _, _ in items:
                self.finish(slot, exc)
            return
        seconds, cpu_s = time.perf_counter() - start, time.thread_time() - start_cpu
        work = sum(size for _, _, size in items)
        self.cost.add(work, seconds)
        self.counters["calls"] += 1
        self.counters["items"] += len(items)
        self.counters["compute_s"] += seconds
        self.counters["compute_cpu_s"] += cpu_s
        self.stepped(len(items), seconds, work, cpu_s)
        for (slot, _, _), result in zip(items, results):
            self.advance(slot, lambda program, r=result: program.complete(r))


def build_engine(site: "EngineSite") -> BatchEngine:
    """The ``batch`` engine kind (``omni_serve.engines.registry``): the stage's ``batch_compute()``."""
    s = site.engine_spec
    return BatchEngine(site.stage.name, site.batch_compute(), max_batch=site.max_batch(),
                       max_active=s.max_active_requests, torch_threads=s.torch_threads, work_unit=site.work_unit,
                       **site.engine_options())
