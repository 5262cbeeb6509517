"""Shared by the per-graph ceiling scripts (benchmarks/glm_image/ceiling.py, benchmarks/qwen2_5_omni/ceiling.py,
benchmarks/qwen_image/ceiling.py): an AR stage's cost per request on the AR engine, a timed call, the table of
per-item stage costs, and a benchmark report's runs set against the ceiling."""

from __future__ import annotations

import asyncio
import json
import time


def ar_seconds_per_request(model, config, program, batch: int, warmup: range) -> float:
    """Seconds per request of ``batch`` programs (``program(i)`` for ``i < batch``) run together on an AR engine with
    one torch thread, after the programs of ``warmup`` (other indices: no prefix-cache hits)."""
    from omni_serve.engines.ar import AREngine

    async def main() -> float:
        engine = AREngine("stage", model, config, torch_threads=1)
        await engine.start()

        async def one(i: int) -> None:
            async for _ in engine.generate(f"r{i}", program(i)):
                pass
        try:
            await asyncio.gather(*(one(i) for i in warmup))
            start = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(batch)))
            return (time.perf_counter() - start) / batch
        finally:
            await engine.cleanup()
    return asyncio.run(main())


def timed(fn, repeats: int = 3) -> float:
    """Seconds per call of ``fn`` (after one unmeasured call)."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def print_costs(costs: dict[str, dict[int, float]], batch: int, total: float) -> None:
    """``costs``: stage -> {batch: seconds per item}; ``total``: the sum at the best batch."""
    print(f"{'stage':<13}{'batch 1':>10}{f'batch {batch}':>10}")
    for stage, by_batch in costs.items():
        print(f"{stage:<13}{by_batch[1]:>10.3f}{by_batch[batch]:>10.3f}")
    print(f"{'sum':<13}{sum(c[1] for c in costs.values()):>10.3f}{total:>10.3f}")


def against_bench(path: str, ceiling: float, rate: str, baseline: str) -> dict:
    """Each engine run of the ``omni-serve bench`` report at ``path`` as a fraction of ``ceiling`` (its
    ``throughput[rate]``), and the ceiling's ratio to the run labelled ``baseline``."""
    with open(path) as f:
        bench = json.load(f)
    runs = {run["label"]: run["throughput"][rate] for run in bench["runs"]}
    out = {}
    if runs.get(baseline):
        out[f"ceiling_over_{baseline}"] = ceiling / runs[baseline]
        print(f"bench: {baseline} {runs[baseline]:.3f} {rate} -> the ceiling is {ceiling / runs[baseline]:.2f}x it")
    for label, value in runs.items():
        if label.startswith("engine"):
            out[label] = {rate: value, "measured_over_ceiling": value / ceiling}
            print(f"bench: {label} {value:.3f} {rate} = {value / ceiling:.2f} of the ceiling")
    return out


def write_report(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
