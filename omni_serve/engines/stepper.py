"""Step engine for one-shot and light stages: each tick steps every ready program once, round-robin.

Contract: see ``omni_serve.engines.loop.LoopEngine``. Programs are ``StageProgram``s; errors inside a
program end that request only (re-raised to its caller). Autoregressive stages use
``omni_serve.engines.ar.AREngine`` instead, which fuses all requests into one batched forward per step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from omni_serve.engines.loop import LoopEngine, Slot

if TYPE_CHECKING:
    from omni_serve.engines.registry import EngineSite


class StepEngine(LoopEngine):
    def _ready_slots(self) -> list[Slot]:
        ready = []
        for slot in self.live_slots():
            with slot.lock:
                if slot.program.ready():
                    ready.append(slot)
        return ready

    def tick(self) -> None:
        start, start_cpu, ready = time.perf_counter(), time.thread_time(), self._ready_slots()
        for slot in ready:
            self.advance(slot, lambda program: program.step())
        if ready:  # a tick that found nothing ready (an abort raced it) is no step
            self.stepped(len(ready), time.perf_counter() - start, cpu_s=time.thread_time() - start_cpu)


def build_engine(site: "EngineSite") -> StepEngine:
    """The ``step`` engine kind (``omni_serve.engines.registry``)."""
    s = site.engine_spec
    return StepEngine(site.stage.name, max_active=s.max_active_requests, torch_threads=s.torch_threads,
                      **site.engine_options())
