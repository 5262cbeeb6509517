"""Percentiles and the summary statistics every bench report uses.

Contract: ``percentile(sorted_values, q)`` interpolates linearly between closest ranks (numpy's default);
``stats(values)`` -> ``{"n", "mean", "p50", "p95", "p99"}`` of the values that are not None, or None without any.
"""

from __future__ import annotations

import math


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats(values: list[float]) -> dict[str, float] | None:
    vals = sorted(float(v) for v in values if v is not None)
    if not vals:
        return None
    return {"n": len(vals), "mean": sum(vals) / len(vals), "p50": percentile(vals, 50),
            "p95": percentile(vals, 95), "p99": percentile(vals, 99)}
