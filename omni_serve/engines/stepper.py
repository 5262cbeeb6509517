"""Step engine for one-shot and light stages: each tick steps every ready program once, round-robin.

Contract: see ``omni_serve.engines.loop.LoopEngine``. Programs are ``StageProgram``s; errors inside a
program end that request only (re-raised to its caller). Autoregressive stages use
``omni_serve.engines.ar.AREngine`` instead, which fuses all requests into one batched forward per step.
"""

from __future__ import annotations

import logging

from omni_serve.engines.loop import END, LoopEngine, Slot

log = logging.getLogger(__name__)


class StepEngine(LoopEngine):
    def has_work(self) -> bool:
        return any(not s.aborted and s.program.ready() for s in self._slots.values())

    def _ready_slots(self) -> list[Slot]:
        ready = []
        for slot in self.live_slots():
            with slot.lock:
                if slot.program.ready():
                    ready.append(slot)
        return ready

    def tick(self) -> None:
        for slot in self._ready_slots():
            with slot.lock:
                if slot.aborted:
                    continue
                try:
                    outputs = slot.program.step()
                except BaseException as exc:  # noqa: BLE001 - reported to the request's caller
                    log.exception("%s: request %s failed", self.name, slot.request_id)
                    self.finish(slot, exc)
                    continue
                self.emit(slot, outputs)
                if slot.program.done:
                    self.finish(slot, END)
