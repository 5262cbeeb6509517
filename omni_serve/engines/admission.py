"""Admission, load accounting and drain, written once for every engine (the native loop engines and vLLM's).

Contract: ``Admission(name, max_active)`` bounds the requests an engine runs at once. ``await enter(request_id)``
admits a request, waiting (FIFO) while ``max_active`` are admitted; ``leave(request_id)`` ends it (every request
that entered leaves exactly once, from a ``finally``). ``queued`` counts the requests waiting, ``admitted`` holds
the ids admitted. ``close()`` stops admitting for good: new requests and those waiting get
``omni_serve.api.errors.Draining``; ``wait_idle(timeout_s)`` waits until every admitted request has left.

The load formula (``load_signals``), read by ``omni_serve.autoscaling`` and ``omni_serve.metrics``:
``utilization`` is the busy fraction of the engine over the last ``load_window_s`` (``BusyMeter``), ``backlog`` the
work ready beyond what one step serves in units of full steps (the engine defines it), ``queued`` the requests
waiting for admission, ``active`` the requests admitted, and ``load`` = utilization + backlog + queued /
max_active, the demand on the replica as a fraction of what it can serve (> 1: saturated with work waiting).

``AdmittingEngine`` is the part of ``omni_serve.engines.base.Engine`` built on these, shared by ``LoopEngine`` and
``VllmEngine``: ``load()`` (the formula plus the engine's ``extra_load()``) and ``drain(deadline_s)``. A subclass
brackets each request with ``admission.enter``/``leave``, keeps ``busy`` up to date, defines ``num_active`` and
``backlog()``, and makes ``abort`` end the request's ``generate`` with ``aborted_error(request_id)`` (``Draining``
once the engine shuts down, so the caller retries elsewhere).
"""

from __future__ import annotations

import asyncio
import logging

from omni_serve.api.errors import Draining
from omni_serve.engines.base import DrainReport, Engine
from omni_serve.engines.load import BusyMeter

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, name: str, max_active: int):
        self.name, self.max_active = name, max_active
        self.queued = 0
        self.admitted: set[str] = set()
        self.closed = False
        self._slots = asyncio.Semaphore(max_active)
        self._idle = asyncio.Event()

    def _refused(self, request_id: str) -> Draining:
        return Draining(f"engine {self.name} is draining (its replica is shutting down) and admits no new "
                        f"request ({request_id})")

    async def enter(self, request_id: str) -> None:
        if self.closed:
            raise self._refused(request_id)
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        if self.closed:
            # Woken by close() or by a request leaving: hand the wake-up on, so every waiter is refused now
            # rather than when a slot frees up.
            self._slots.release()
            raise self._refused(request_id)
        self.admitted.add(request_id)

    def leave(self, request_id: str) -> None:
        self.admitted.discard(request_id)
        self._slots.release()
        if self.closed and not self.admitted:
            self._idle.set()

    def close(self) -> tuple[set[str], int]:
        """Stop admitting; returns the ids admitted now and how many waiting requests this refuses."""
        refused = 0
        if not self.closed:
            self.closed, refused = True, self.queued
            if refused:
                self._slots.release()  # wakes the first waiter, which refuses and wakes the next (see enter)
        if not self.admitted:
            self._idle.set()
        return set(self.admitted), refused

    async def wait_idle(self, timeout_s: float) -> bool:
        """After ``close()``: whether every admitted request left within ``timeout_s`` seconds."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            return False
        return True


def load_signals(utilization: float, backlog: float, queued: int, max_active: int, active: int) -> dict[str, float]:
    """The load formula every engine reports (see the module docstring)."""
    return {"load": utilization + backlog + queued / max_active, "utilization": utilization, "backlog": backlog,
            "queued": float(queued), "active": float(active)}


class AdmittingEngine(Engine):
    def __init__(self, name: str, max_active: int, load_window_s: float = 5.0):
        self.name = name
        self.max_active = max_active
        self.admission = Admission(name, max_active)
        self.busy = BusyMeter(load_window_s)
        self.on_step = None

    # -- what a subclass defines ---------------------------------------------------------------------------
    @property
    def num_active(self) -> int:
        """Requests admitted and running (the ``active`` load signal)."""
        return len(self.admission.admitted)

    def backlog(self) -> float:
        """Work ready beyond what one step serves, in full steps (0 when everything ready runs at once)."""
        return 0.0

    def extra_load(self) -> dict[str, float]:
        """Engine-specific autoscaling signals, added to ``load()``."""
        return {}

    # -- shared ----------------------------------------------------------------------------------------------
    def load(self) -> dict[str, float]:
        signals = load_signals(self.busy.value(), self.backlog(), self.admission.queued, self.max_active,
                               self.num_active)
        return {**signals, **self.extra_load()}

    def aborted_error(self, request_id: str) -> Exception:
        """What the ``generate`` of an aborted request raises: ``Draining`` while the engine shuts down."""
        if self.admission.closed:
            return Draining(f"request {request_id} was aborted: engine {self.name} shut down before it finished")
        return RuntimeError(f"request {request_id} was aborted on engine {self.name}")

    async def drain(self, deadline_s: float) -> DrainReport:
        in_flight, refused = self.admission.close()
        if in_flight or refused:
            log.info("%s: draining: waiting up to %.1f s for %d requests in flight (%d waiting refused)",
                     self.name, deadline_s, len(in_flight), refused)
        await self.admission.wait_idle(deadline_s)
        late = [rid for rid in in_flight if rid in self.admission.admitted]
        for request_id in late:
            await self.abort(request_id)
        report = DrainReport(finished=len(in_flight) - len(late), aborted=len(late), refused=refused)
        if late:
            log.warning("%s: drained: %d requests finished, %d aborted at the %.1f s deadline, %d refused",
                        self.name, report.finished, report.aborted, deadline_s, refused)
        elif in_flight or refused:
            log.info("%s: drained: %d requests finished, %d refused", self.name, report.finished, refused)
        return report
