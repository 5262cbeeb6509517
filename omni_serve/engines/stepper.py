"""Step engine for one-shot and light stages: each tick steps every ready program once, round-robin.

Contract: see ``omni_serve.engines.loop.LoopEngine``. Programs are ``StageProgram``s; errors inside a
program end that request only (re-raised to its caller). Autoregressive stages use
``omni_serve.engines.ar.AREngine`` instead, which fuses all requests into one batched forward per step.
"""

from __future__ import annotations

import time

from omni_serve.engines.loop import LoopEngine, Slot


class StepEngine(LoopEngine):
    def _ready_slots(self) -> list[Slot]:
        ready = []
        for slot in self.live_slots():
            with slot.lock:
                if slot.program.ready():
                    ready.append(slot)
        return ready

    def tick(self) -> None:
        start, ready = time.perf_counter(), self._ready_slots()
        for slot in ready:
            self.advance(slot, lambda program: program.step())
        self.stepped(len(ready), time.perf_counter() - start)
