"""The async/thread plumbing every engine shares: one worker thread per replica, requests on asyncio.

Contract: see ``omni_serve.engines.base.Engine``. ``LoopEngine.generate`` registers a request (a *slot*:
its program, its event loop and an output queue), pumps its upstream inputs into ``program.feed`` from an
async task (so a request waiting for upstream chunks never blocks the others), and yields what the worker
thread emits. The worker loops ``while has_work(): tick()``; subclasses implement those two and call
``emit``/``finish``. ``abort`` marks the slot, stops its pump and calls ``on_abort`` (subclasses free memory
there) and ends the request's ``generate`` with an error; ``cleanup`` aborts everything and joins the worker
(idempotent). ``max_active`` bounds the requests a replica accepts at once; more wait in ``generate`` (admission
control before any state is built); admission, ``drain`` and the load formula are
``omni_serve.engines.admission.AdmittingEngine``'s.

Load (autoscaling): ``utilization`` is the busy fraction of the worker; subclasses define ``backlog()`` (work
ready beyond what one step serves) and add their own signals (KV use, batch occupancy, diffusion steps in flight)
in ``extra_load()``. A ``tick()`` that returns ``False`` did no work (it waited) and is not counted as busy.

Locking: ``slot.lock`` guards a program's state between its pump (event loop) and the worker; ``_cv``
guards the slot table and wakes the worker.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch

from omni_serve.engines.admission import AdmittingEngine
from omni_serve.engines.base import StageProgram
from omni_serve.engines.load import CpuUse

log = logging.getLogger(__name__)
END = object()


@dataclass(eq=False)
class Slot:
    request_id: str
    program: StageProgram
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    aborted: bool = False
    finished: bool = False
    pump: asyncio.Task | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


def log_failure(logger: logging.Logger, exc: BaseException, message: str, *args: Any) -> None:
    """Log a request's failure with its traceback as text. ``log.exception`` would put the live traceback in
    the record, and a handler that keeps records (a buffer, a test's capture) would keep the failed
    request's frames, and with them its program and upstream payloads, alive."""
    logger.error(message + "\n%s", *args, "".join(traceback.format_exception(exc)).rstrip())


def _drop_tracebacks(exc: BaseException) -> None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


class LoopEngine(AdmittingEngine):
    def __init__(self, name: str, max_active: int = 64, torch_threads: int | None = None,
                 load_window_s: float = 5.0):
        super().__init__(name, max_active, load_window_s)
        self.torch_threads = torch_threads
        self._slots: dict[str, Slot] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.error: BaseException | None = None  # why the worker died, if it did
        self._tick_since: float | None = None  # monotonic start of the step running now (None: between steps)
        self._hang_s = 0.0  # test hook (``hang_next_step``): the next step first sleeps this long
        self.cpu = CpuUse(load_window_s)

    # -- subclass hooks (worker thread) -------------------------------------------------------------------
    def has_work(self) -> bool:
        """Called with ``_cv`` held: whether ``tick`` can make progress now (default: a program is ready)."""
        return any(not s.aborted and s.program.ready() for s in self._slots.values())

    @abc.abstractmethod
    def tick(self) -> bool | None:
        """Advance the requests in flight by one unit (one batched forward); ``False``: nothing to run yet."""

    def stepped(self, batch: int, seconds: float, size: float | None = None, cpu_s: float | None = None) -> None:
        """Report one batched computation (worker thread): to ``on_step``, and with its size in the engine's cost
        units (rows, frames; default ``batch``) and the worker thread's CPU seconds in it to ``cpu``."""
        if cpu_s is not None:
            self.cpu.step(batch if size is None else size, cpu_s)
        if self.on_step is not None:
            self.on_step(batch, seconds)

    def on_abort(self, slot: Slot) -> None:
        """Called once when a request is aborted or cancelled (any thread); free its memory here."""
        with slot.lock:
            slot.program.release()

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.name}", daemon=True)
        self._thread.start()

    async def cleanup(self) -> None:
        self.admission.close()  # what is still running is cut short by a shutdown (Draining), not a failure
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

    def stats(self) -> dict:
        return {"active": self.num_active}

    def cpu_use(self) -> dict[str, float]:
        return self.cpu.value()

    @property
    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def stalled_s(self) -> float:
        """Seconds the step running now has taken (0 between steps)."""
        since = self._tick_since
        return 0.0 if since is None else time.monotonic() - since

    def hang_next_step(self, seconds: float) -> None:
        """Test hook: the worker's next step blocks ``seconds`` first, as a hung kernel or a deadlock would."""
        self._hang_s = seconds
        self.wake()

    # -- requests ----------------------------------------------------------------------------------------
    async def generate(self, request_id: str, program: StageProgram,
                       inputs: AsyncIterator[Any] | None = None) -> AsyncIterator[Any]:
        if self._thread is None:
            await self.start()
        if request_id in self._slots:
            raise ValueError(f"request {request_id} is already running on {self.name}")
        await self.admission.enter(request_id)
        slot = Slot(request_id, program, asyncio.get_running_loop(), asyncio.Queue())
        del program  # from here the slot holds it (see the finally below)
        try:
            if inputs is not None:
                slot.pump = asyncio.create_task(self._pump(slot, inputs))
            with self._cv:
                if self._stopped or self.error is not None:
                    raise RuntimeError(f"engine {self.name} is stopped" + (f" ({self.error!r})" if self.error else ""))
                self._slots[request_id] = slot
                self._cv.notify_all()
            try:
                while True:
                    item = await slot.queue.get()
                    if item is END:
                        return
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                await self.abort(request_id)
                # A request that ended in the worker (finish) is no longer in the slot table: stop its pump
                # here too, so no upstream chunk is read or fed after it ended.
                if slot.pump is not None and not slot.pump.done():
                    slot.pump.cancel()
                slot.pump = None  # the cancelled task's error -> traceback -> pump frame -> slot: no cycle
        finally:
            self.admission.leave(request_id)
            # A raised error's traceback keeps this frame, and the frame the error: a cycle only the garbage
            # collector frees, perhaps long after. Drop the request's state from the frame now, so zero-copy
            # payloads (views into connector memory) return when the request ends.
            slot = inputs = item = None

    async def _pump(self, slot: Slot, inputs: AsyncIterator[Any]) -> None:
        try:
            async for item in inputs:
                with slot.lock:
                    if slot.finished or slot.aborted:
                        return  # ended (done, failed or aborted): what it was released must stay released
                    slot.program.feed(item)
                self.wake()
            with slot.lock:
                if not (slot.finished or slot.aborted):
                    slot.program.close_input()
            self.wake()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # upstream failed: fail this request with the same error
            self.finish(slot, exc)
            self.on_abort(slot)  # and free what it holds now (its later abort() finds nothing to do)
        finally:
            # The task keeps its error's traceback, and so this frame: let it hold no chunk (zero-copy views
            # into connector memory) and no slot once the pump is over.
            item = slot = inputs = None  # noqa: F841

    async def abort(self, request_id: str) -> None:
        with self._cv:
            slot = self._slots.pop(request_id, None)
            if slot is not None:
                slot.aborted = True
            self._cv.notify_all()
        if slot is None:
            return
        if slot.pump is not None and not slot.pump.done():
            slot.pump.cancel()
        self.on_abort(slot)
        self.finish(slot, self.aborted_error(request_id))  # a caller still iterating generate() gets the error

    # -- worker side -------------------------------------------------------------------------------------
    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def live_slots(self) -> list[Slot]:
        with self._cv:
            return [s for s in self._slots.values() if not s.aborted and not s.finished]

    def emit(self, slot: Slot, outputs: list[Any]) -> None:
        for out in outputs:
            slot.loop.call_soon_threadsafe(slot.queue.put_nowait, out)

    def advance(self, slot: Slot, fn: Callable[[StageProgram], list[Any]]) -> None:
        """Run ``fn(program)`` under the request's lock, emit its outputs and end the request when done.
        An exception fails this request only (its caller gets it)."""
        with slot.lock:
            if slot.aborted or slot.finished:
                return
            try:
                outputs = fn(slot.program)
            except Exception as exc:  # noqa: BLE001 - reported to the request's caller
                log_failure(log, exc, "%s: request %s failed", self.name, slot.request_id)
                self.finish(slot, exc)
                return
            self.emit(slot, outputs)
            if slot.program.done:
                self.finish(slot, END)

    def finish(self, slot: Slot, final: Any = END) -> None:
        """End a request: ``END`` for success or the exception its caller gets. The exception reaches the
        caller without its traceback (whoever caught it logs that): its frames hold the request's program
        and inputs, and an error the caller keeps (Serve does) would keep them alive."""
        if slot.finished:
            return
        if isinstance(final, BaseException):
            _drop_tracebacks(final)
        slot.finished = True
        with self._cv:
            self._slots.pop(slot.request_id, None)
        try:
            slot.loop.call_soon_threadsafe(slot.queue.put_nowait, final)
        except RuntimeError:  # the request's loop is gone
            pass

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a dead worker must fail its requests, not hang them
            log.exception("%s: engine worker died", self.name)
            self.error = exc
            for slot in self.live_slots():
                self.finish(slot, RuntimeError(f"engine {self.name} failed: {exc!r}"))

    def _loop(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        while True:
            with self._cv:
                while not self._stopped and not self.has_work():
                    self._cv.wait(timeout=0.5)
                if self._stopped:
                    return
            self.busy.start()
            worked = None
            self._tick_since = time.monotonic()
            try:
                if self._hang_s:
                    hang, self._hang_s = self._hang_s, 0.0
                    time.sleep(hang)
                with torch.inference_mode():
                    worked = self.tick()
            finally:
                self._tick_since = None
                if worked is False:  # it only waited: not busy
                    self.busy.discard()
                else:
                    self.busy.stop()
