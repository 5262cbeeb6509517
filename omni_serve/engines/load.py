"""Load signals an engine reports for autoscaling: busy time and averages over a sliding window.

Contract: ``BusyMeter`` measures the fraction of wall time the engine's worker spent computing over roughly
the last ``window_s`` seconds (exponentially weighted, so it needs no sample history): ``start()`` /
``stop()`` bracket a busy period (``discard()`` drops one that was only a wait), ``value()`` reads the
fraction in [0, 1], including a period still in progress (a long batch shows up while it runs). ``DecayingMean`` is a time-weighted average of samples over
the same kind of window. Both are thread-safe: the worker writes, the replica's event loop reads.

These feed ``LoopEngine.load()`` -> ``StageDeployment.record_autoscaling_stats()`` -> Ray Serve's
autoscaler, where ``omni_serve.autoscaling`` policies turn them into replica counts.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Callable


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
