"""A fixed CPU workload timed beside each benchmark phase, so a ratio measured across machine-speed drift shows it.

Why: on shared machines the same in-process work was measured 10-25% slower within an hour (docs/benchmarks.md),
and a same-run ratio (engine throughput over a baseline measured minutes later) inherits any drift between the
two phases. ``omni-serve bench`` times ``calibrate()`` before the engine runs and again before the baselines
(after the server stopped) and records both in the report; ``drift_note`` flags a difference above
``DRIFT_WARN`` (10%) so a skewed ratio is not taken at face value.

Contract: ``calibrate(threads=1)`` returns the median seconds of ``reps`` repetitions of a fixed mix on this
process' CPU: a float32 and a bfloat16 matrix product at decode/diffusion-like sizes and an elementwise pass over
16 MiB (memory traffic). It restores torch's thread count. Values are comparable within one machine only.
"""

from __future__ import annotations

import statistics
import time

# Relative difference between two calibrations worth a note in the report. Back-to-back calibrations on the
# development machine spread by up to ~12% (median of 15), so smaller differences are not told apart from noise.
DRIFT_WARN = 0.10


def _workload(torch, gen) -> None:
    a = torch.randn(256, 1024, generator=gen)
    w = torch.randn(1024, 1024, generator=gen)
    for _ in range(4):
        a = torch.tanh(a @ w * 0.03)
    b = a.to(torch.bfloat16)
    wb = w.to(torch.bfloat16)
    for _ in range(4):
        b = torch.tanh(b @ wb * 0.03)
    x = torch.randn(4 << 20, generator=gen)
    for _ in range(4):
        x = x * 0.5 + 1.0


def calibrate(threads: int = 1, reps: int = 15) -> float:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        _workload(torch, gen)  # warm-up: first-call allocations and kernel selection
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            _workload(torch, gen)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(before)


def drift_note(engine_s: float, baseline_s: float) -> str | None:
    """A report note when the machine ran at a different speed for the baselines than for the engine runs."""
    drift = baseline_s / engine_s - 1
    if abs(drift) <= DRIFT_WARN:
        return None
    slower = "slower" if drift > 0 else "faster"
    return (f"machine speed drifted: the calibration took {baseline_s * 1000:.0f} ms before the baselines against "
            f"{engine_s * 1000:.0f} ms before the engine runs ({abs(drift):.0%} {slower}); ratios between them are "
            f"skewed by about that much")
