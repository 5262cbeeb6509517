"""Load signals an engine reports for autoscaling: busy time and averages over a sliding window.

Contract: ``BusyMeter`` measures the fraction of wall time the engine's worker spent computing over roughly
the last ``window_s`` seconds (exponentially weighted, so it needs no sample history): ``start()`` /
``stop()`` bracket a busy period (``discard()`` drops one that was only a wait), ``value()`` reads the
fraction in [0, 1], including a period still in progress (a long batch shows up while it runs). ``DecayingMean`` is a time-weighted average of samples over
the same kind of window. ``CpuUse`` is the replica process' CPU seconds per second and the part of it that is
fixed per step (admission by real-time capacity projects it to more streams). All are thread-safe: the worker
writes, the replica's event loop reads.

The first two feed ``LoopEngine.load()`` -> ``StageDeployment.record_autoscaling_stats()`` -> Ray Serve's
autoscaler, where ``omni_serve.autoscaling`` policies turn them into replica counts.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable

from omni_serve.engines.deadlines import CostModel


class BusyMeter:
    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._acc = 0.0  # decayed busy seconds, as of self._at
        self._at = clock()
        self._since: float | None = None

    def _decay_to(self, now: float) -> None:
        self._acc *= math.exp(-(now - self._at) / self.window_s)
        self._at = now

    def _busy_part(self, start: float, end: float) -> float:
        """Weight of the busy period [start, end] as seen at ``end``: the integral of exp(-(end-x)/window)."""
        return self.window_s * (1.0 - math.exp(-(end - start) / self.window_s))

    def start(self) -> None:
        with self._lock:
            if self._since is None:
                self._since = self._clock()

    def stop(self) -> None:
        with self._lock:
            if self._since is None:
                return
            now = self._clock()
            self._decay_to(now)
            self._acc += self._busy_part(self._since, now)
            self._since = None

    def discard(self) -> None:
        """End a period started by ``start()`` without counting it (it turned out to be a wait)."""
        with self._lock:
            self._since = None

    def value(self) -> float:
        """Busy fraction of the last ``window_s`` seconds (exponentially weighted), in [0, 1]."""
        with self._lock:
            now = self._clock()
            acc = self._acc * math.exp(-(now - self._at) / self.window_s)
            if self._since is not None:
                acc += self._busy_part(self._since, now)
        return min(1.0, max(0.0, acc / self.window_s))


class DecayingMean:
    """Time-weighted mean of samples over roughly the last ``window_s`` seconds (0 before any sample)."""

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._mean = 0.0
        self._at: float | None = None

    def add(self, x: float) -> None:
        with self._lock:
            now = self._clock()
            if self._at is None:
                self._mean = x
            else:
                keep = math.exp(-(now - self._at) / self.window_s)
                self._mean = self._mean * keep + x * (1.0 - keep)
            self._at = now

    def value(self) -> float:
        with self._lock:
            return self._mean


class CpuUse:
    """What a replica's process spends of the CPU, for admission by real-time capacity
    (``omni_serve.realtime_projection``): ``per_s``, the process' CPU seconds per wall second over roughly the last
    ``window_s`` (every thread: the engine's, its torch threads, the event loop moving payloads), and ``fixed_per_s``,
    the part of it that does not grow with the requests in a step: the steps per second times the fixed CPU cost
    of a step (``CostModel`` over the steps' sizes and their CPU seconds). What grows with the streams is the rest.

    ``engine_per_s`` and the steps' fixed cost are the engine's worker thread's CPU (``thread_time``): what one thread
    computing one step at a time can spend at most one CPU second per second of.

    An average over a window that began before the replica got busy reads low for its first seconds (the idle time
    is in it): about a third of the rate two seconds in, with a 5 s window, when admission decides on a second stream.
    So the rates are divided by the weight the active time has in the window (an exponential average's bias
    correction), from the first step after ``window_s`` without one, and at most ``1 / MIN_WEIGHT``.

    ``step(size, cpu_s)`` from the engine's worker after each batched computation (``cpu_s``: the worker thread's);
    ``value()`` from anywhere."""

    MIN_WEIGHT = 0.2  # the correction's cap: in the first second of activity the rates are noisy anyway

    def __init__(self, window_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 cpu_clock: Callable[[], float] = time.process_time):
        self.window_s, self._clock, self._cpu_clock = window_s, clock, cpu_clock
        self._lock = threading.Lock()
        self.cost = CostModel()  # CPU seconds of a step by its size
        self._rate = 0.0  # decayed process CPU seconds per second
        self._steps = 0.0  # decayed steps per second
        self._engine = 0.0  # decayed CPU seconds per second of the steps themselves (the engine's thread)
        self._at = clock()
        self._cpu_at = cpu_clock()
        self._active_since: float | None = None  # first step after window_s without one
        self._last_step: float | None = None

    def _advance(self, now: float) -> None:
        """Fold the process CPU spent since the last sample into the rate (lock held)."""
        dt = now - self._at
        if dt <= 0:
            return
        cpu = self._cpu_clock()
        keep = math.exp(-dt / self.window_s)
        self._rate = self._rate * keep + (cpu - self._cpu_at) / dt * (1.0 - keep)
        self._steps *= keep
        self._engine *= keep
        self._at, self._cpu_at = now, cpu

    def step(self, size: float, cpu_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._advance(now)
            if self._last_step is None or now - self._last_step > self.window_s:
                self._active_since = now
            self._last_step = now
            self.cost.add(size, cpu_s)
            self._steps += 1.0 / self.window_s  # one step, spread over the window: a rate once decayed
            self._engine += cpu_s / self.window_s

    def value(self) -> dict[str, float]:
        """``{"per_s", "engine_per_s", "fixed_per_s"}`` (before the first step: the process' idle use, nothing else)."""
        with self._lock:
            now = self._clock()
            self._advance(now)
            weight = 1.0
            if self._active_since is not None:
                weight = max(self.MIN_WEIGHT, 1.0 - math.exp(-(now - self._active_since) / self.window_s))
            rate, steps = self._rate / weight, self._steps / weight
            c = self.cost.coefficients()
            engine = min(self._engine / weight, rate)
            fixed = 0.0 if c is None else min(c[0] * steps, engine)
            return {"per_s": rate, "engine_per_s": engine, "fixed_per_s": fixed}
