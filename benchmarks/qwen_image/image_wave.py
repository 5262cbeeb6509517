"""One wave of concurrent image requests against a running Qwen-Image server, with each stage's share.

Sends one warm-up request, then N requests at once (equal-length prompts unless --prompt-words varies them),
and prints the wave's wall time and, per stage, the engine calls, items and compute seconds it took (the
``BatchEngine`` counters in ``/health``). docs/qwen_image.md quotes its numbers.

    python benchmarks/qwen_image/image_wave.py --url http://127.0.0.1:8124 [--n 8] [--size 128x128] [--steps 20]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

COUNTERS = ("calls", "items", "compute_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8124")
    parser.add_argument("--n", type=int, default=8, help="requests in the wave")
    parser.add_argument("--size", default="128x128")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--negative-prompt", default=" ", help="true CFG when set (default ' ')")
    args = parser.parse_args()

    def one(i: int) -> float:
        start = time.perf_counter()
        r = httpx.post(f"{args.url}/v1/images/generations", timeout=600, json={
            "prompt": f"a photo of a red cat number {i % 10} in the sky", "size": args.size, "seed": i,
            "num_inference_steps": args.steps, "negative_prompt": args.negative_prompt, "cache": {"mode": "off"}})
        r.raise_for_status()
        return time.perf_counter() - start

    def stages() -> dict:
        return httpx.get(f"{args.url}/health", timeout=30).json()["stages"]

    one(0)
    before = stages()
    start = time.perf_counter()
    with ThreadPoolExecutor(args.n) as pool:
        latencies = list(pool.map(one, range(args.n)))
    wall = time.perf_counter() - start
    after = stages()
    print(f"wave of {args.n} at {args.size}, {args.steps} steps: {wall:.2f} s "
          f"({args.n / wall:.3f} images/s; latency max {max(latencies):.2f} s)")
    for stage, stats in after.items():
        print(f"  {stage:12s} " + "  ".join(f"{k} {stats[k] - before[stage][k]:.2f}" for k in COUNTERS))


if __name__ == "__main__":
    main()
