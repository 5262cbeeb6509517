"""Work ordered by deadline instead of arrival: which ready requests a batch engine computes now, and which wait.

Contract:
- ``CostModel`` learns what one compute call costs, ``seconds = fixed + per_unit * size`` (``size``: the programs'
  ``work_size()`` summed), from the calls the engine times (``add``), recent calls weighing most. ``estimate(size)``
  is None until a call was timed.
- ``choose_by_deadline(ready, now, cost)`` takes ``Ready`` items (a deadline on ``time.monotonic()``'s clock, or
  None for work that has none) and returns those to compute now, most urgent first. Work without deadlines, or
  before the first call was timed, is all taken (a full batch is the cheapest way through it). Otherwise, in
  deadline order: the most urgent is taken; each next item joins when the batch with it still ends before every
  deadline in it, or when waiting would make it late (its deadline comes before this batch and then its own call
  would end): a batch is as large as the deadlines in it allow. The rest wait for a later call: a
  stream with audio buffered yields to one about to starve or still waiting for its first audio.

- ``call_budget(others, now, cost)``: how long the next call may run, in ``cost`` units of size: until the first of
  the deadlines of the work *not* in it (``others``: live work with deadlines, ready or still waiting for input),
  less that work's own call (it runs after this one). None when nothing bounds it. The engine shortens the chosen
  units to fit (``BatchProgram.limit``), most urgent first, so that a call started while every client had audio
  buffered cannot make a stream that is about to starve wait past its deadline: a call is not preemptible, so its
  length is the wait it imposes.

Why not simply the earliest deadlines first, in full batches: a batch runs to its end once started (a step is not
preemptible), so a large batch of work that is not due delays the work that is; and why not one request at a time:
most of a call's cost on these models is fixed (weights read, kernels launched), so batching is what makes
throughput. The rule above is the compromise, and with no pressure (every deadline far) it batches everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class Ready:
    item: Any  # what the engine computes (its slot)
    deadline: float | None  # when its output is due (time.monotonic()); None: no deadline
    size: float = 1.0  # its share of a call's cost (CostModel units)
    least: float | None = None  # the smallest size its unit can be shortened to; None: it cannot be


class CostModel:
    """``seconds = fixed + per_unit * size`` by least squares over the timed calls, each weighing ``decay`` times
    the one after it (so the model follows a machine whose load changes)."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, size: float, seconds: float) -> None:
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + size, d * self.sy + seconds
        self.sxx, self.sxy = d * self.sxx + size * size, d * self.sxy + size * seconds

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds per call, seconds per unit of size), or None before any call was timed."""
        if self.w == 0:
            return None
        var = self.w * self.sxx - self.sx * self.sx
        if var > 1e-9 * max(self.w * self.sxx, 1e-30):
            per_unit = (self.w * self.sxy - self.sx * self.sy) / var
            fixed = (self.sy - per_unit * self.sx) / self.w
            if per_unit >= 0 and fixed >= 0:
                return fixed, per_unit
        # one size seen so far, or a fit that says a call costs less than nothing: cost per unit only
        return (0.0, self.sy / self.sx) if self.sx > 0 else (self.sy / self.w, 0.0)

    def estimate(self, size: float) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * size


def choose_by_deadline(ready: list[Ready], now: float, cost: CostModel) -> list[Ready]:
    if not ready or all(r.deadline is None for r in ready) or cost.estimate(0) is None:
        return list(ready)
    order = sorted(ready, key=lambda r: math.inf if r.deadline is None else r.deadline)
    chosen, size = [order[0]], order[0].size
    earliest = order[0].deadline if order[0].deadline is not None else math.inf
    for r in order[1:]:
        deadline = math.inf if r.deadline is None else r.deadline
        if now + cost.estimate(size + r.size) <= min(earliest, deadline):
            pass  # everyone in the batch is still on time with it
        elif deadline <= now + cost.estimate(size) + cost.estimate(r.size):
            pass  # waiting for the next call would make it late: it joins this one
        else:
            continue  # it has time: it waits for a later call
        chosen.append(r)
        size += r.size
        earliest = min(earliest, deadline)
    return chosen


def call_budget(others: list[Ready], now: float, cost: CostModel) -> float | None:
    """The size the next call may have so that it ends before every deadline of ``others`` less their own call
    (at their least size); None when nothing bounds it or nothing was timed yet. Work whose deadline cannot be met
    any more (its own call would end after it even if it started now) does not bound it: a shorter call would not
    save it, and shortening every call then would only cost throughput."""
    c = cost.coefficients()
    if c is None or c[1] <= 0:
        return None
    fixed, per_unit = c
    latest = math.inf
    for r in others:
        if r.deadline is not None:
            start_by = r.deadline - cost.estimate(r.least if r.least is not None else r.size)
            if start_by > now:
                latest = min(latest, start_by)
    if latest == math.inf:
        return None
    return max(0.0, (latest - now - fixed) / per_unit)


def fit_to_budget(chosen: list[Ready], budget: float | None) -> list[tuple[Ready, float | None]]:
    """``chosen`` (most urgent first) cut to ``budget``: each with the size it is limited to (None: not limited).
    The budget is never below every chosen unit at its least size (a call keeps its batch, only its units get
    shorter); the most urgent take their whole size first, the later ones what is left, at least their least size."""
    if budget is None:
        return [(r, None) for r in chosen]
    out: list[tuple[Ready, float | None]] = []
    least_total = sum(r.least if r.least is not None else r.size for r in chosen)
    left = max(budget, least_total)
    spare = left - least_total  # what the units may take beyond their least sizes, most urgent first
    for r in chosen:
        least = r.least if r.least is not None else r.size
        size = least + max(0.0, min(r.size - least, spare))
        spare -= size - least
        out.append((r, size if size < r.size else None))
    return out
