"""Step engine: one worker thread advances every in-flight program of a replica, round-robin.

Contract: see ``omni_serve.engines.base.Engine``. Each tick the worker collects the programs that are
``ready()`` and hands them to ``run_tick`` (one ``step()`` each here; a batching engine overrides
``run_tick`` to fuse them into one forward). Inputs arrive through a per-request async pump, so a program
waiting for upstream chunks never blocks the others. Outputs cross back to the request's event loop through
``call_soon_threadsafe``. Errors inside a program end that request only (re-raised to its caller).
``max_active`` bounds concurrent programs; extra requests wait for a slot (admission control).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch

from omni_serve.engines.base import Engine, StageProgram

log = logging.getLogger(__name__)
_END = object()


@dataclass
class _Slot:
    request_id: str
    program: StageProgram
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    aborted: bool = False
    finished: bool = False
    pump: asyncio.Task | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class StepEngine(Engine):
    def __init__(self, name: str, max_active: int = 64, torch_threads: int | None = None):
        self.name = name
        self.max_active = max_active
        self.torch_threads = torch_threads
        self._slots: dict[str, _Slot] = {}
        self._cv = threading.Condition()
        self._admission: asyncio.Semaphore | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._admission = asyncio.Semaphore(self.max_active)
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    async def cleanup(self) -> None:
        with self._cv:
            self._stopped = True
            slots = list(self._slots.values())
            self._cv.notify_all()
        for slot in slots:
            await self.abort(slot.request_id)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    @property
    def num_active(self) -> int:
        return len(self._slots)

    # -- requests ----------------------------------------------------------------------------------------
    async def generate(self, request_id: str, program: StageProgram,
                       inputs: AsyncIterator[Any] | None = None) -> AsyncIterator[Any]:
        if self._thread is None:
            await self.start()
        if request_id in self._slots:
            raise ValueError(f"request {request_id} is already running on {self.name}")
        async with self._admission:
            slot = _Slot(request_id, program, asyncio.get_running_loop(), asyncio.Queue())
            if inputs is not None:
                slot.pump = asyncio.create_task(self._pump(slot, inputs))
            with self._cv:
                if self._stopped:
                    raise RuntimeError(f"engine {self.name} is stopped")
                self._slots[request_id] = slot
                self._cv.notify_all()
            try:
                while True:
                    item = await slot.queue.get()
                    if item is _END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                await self.abort(request_id)

    async def _pump(self, slot: _Slot, inputs: AsyncIterator[Any]) -> None:
        try:
            async for item in inputs:
                with slot.lock:
                    slot.program.feed(item)
                self._wake()
            with slot.lock:
                slot.program.close_input()
            self._wake()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # upstream failed: fail this request with the same error
            self._finish(slot, exc)

    async def abort(self, request_id: str) -> None:
        with self._cv:
            slot = self._slots.pop(request_id, None)
        if slot is None:
            return
        slot.aborted = True
        if slot.pump is not None and not slot.pump.done():
            slot.pump.cancel()
        with slot.lock:  # waits for an in-progress step of this program to finish
            slot.program.release()

    # -- worker ------------------------------------------------------------------------------------------
    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _finish(self, slot: _Slot, final: Any) -> None:
        if slot.finished:
            return
        slot.finished = True
        with self._cv:
            self._slots.pop(slot.request_id, None)
        try:
            slot.loop.call_soon_threadsafe(slot.queue.put_nowait, final)
        except RuntimeError:  # the request's loop is gone
            pass

    def _ready_slots(self) -> list[_Slot]:
        ready = []
        for slot in list(self._slots.values()):
            if slot.aborted or slot.finished:
                continue
            with slot.lock:
                if slot.program.ready():
                    ready.append(slot)
        return ready

    def _run(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        while True:
            with self._cv:
                while not self._stopped and not self._any_ready():
                    self._cv.wait(timeout=0.5)
                if self._stopped:
                    return
            self.run_tick(self._ready_slots())

    def _any_ready(self) -> bool:
        return any(not s.aborted and s.program.ready() for s in self._slots.values())

    def run_tick(self, slots: list[_Slot]) -> None:
        for slot in slots:
            with slot.lock:
                if slot.aborted:
                    continue
                try:
                    outputs = slot.program.step()
                except BaseException as exc:  # noqa: BLE001 - reported to the request's caller
                    log.exception("%s: request %s failed", self.name, slot.request_id)
                    self._finish(slot, exc)
                    continue
                for out in outputs:
                    slot.loop.call_soon_threadsafe(slot.queue.put_nowait, out)
                if slot.program.done:
                    self._finish(slot, _END)
