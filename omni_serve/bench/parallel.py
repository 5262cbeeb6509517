"""A two-rank DiT stage against one rank with two threads: one denoising step of the Qwen-Image DiT stage's batched
computation (``DenoiseCompute``, the packed forward) on the same rows, as a served replica runs it.

Contract: ``python -m omni_serve.bench.parallel --checkpoint DIR [--kind rows|sequence] [--rows 4]
[--size 512x512] [--cfg] [--repeats 5]`` starts a local Ray (2 CPUs), builds the DiT stage's runner twice on the
checkpoint: once with ``parallel.<kind>: 2`` (this process is rank 0 with one torch thread, a rank worker with one
thread computes the other half: of the rows with ``rows``, ``omni_serve.graph.ranks.RowSplitCompute``; of every
row's image tokens with ``sequence``, ``SequenceSplitCompute``; its inputs shipped to it through Ray), once with one
rank and two threads; times one step of ``--rows`` requests each way (median of ``--repeats``, after a warm-up) and
prints one JSON line: both times, their ratio, and the largest relative difference between the two predictions.
On a 2-core CPU both sides use both cores; the ranks pay the shipping of rows and run smaller batches, so expect
little gain here: a GPU per rank is what turns the split into a speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _runner(checkpoint: str, kind: str, ranks: int, threads: int):
    import torch

    from omni_serve.families.qwen_image import FAMILY
    from omni_serve.graph.runner import build_runner

    torch.set_num_threads(threads)
    spec = FAMILY.validate({"checkpoint": checkpoint, "stages.dit.engine.torch_threads": threads,
                            "stages.dit.num_cpus": 1, f"stages.dit.parallel.{kind}": ranks,
                            "stages.dit.parallel.rank_cpus": 1})
    runner = build_runner(FAMILY, "dit", spec)
    return runner, runner.make_engine().compute


def _works(runner, requests: int, height: int, width: int, cfg: bool):
    import torch

    from omni_serve.kits.diffusion.messages import DenoiseCall, PromptEmbeds
    from omni_serve.kits.diffusion.replica.programs import DenoiseProgram

    dim = runner.model.transformer.config.joint_attention_dim
    works = []
    for i in range(requests):
        g = torch.Generator().manual_seed(i)
        call = DenoiseCall(request_id=f"bench-{i}", height=height, width=width, n=1, seed=i, num_steps=20,
                           true_cfg_scale=4.0 if cfg else 1.0, guidance_scale=None)
        program = DenoiseProgram(runner.model, call)
        program.feed(PromptEmbeds(prompt_embeds=torch.randn(12 + 5 * i, dim, generator=g),
                                  negative_embeds=torch.randn(7, dim, generator=g) if cfg else None))
        works.append(program.work()[1])
    return works


def _timed(compute, works, repeats: int):
    import torch

    with torch.inference_mode():  # as the engine thread computes
        out = compute(works)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            out = compute(works)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, out


def main(argv: list[str] | None = None) -> int:
    import ray

    parser = argparse.ArgumentParser(prog="python -m omni_serve.bench.parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a Qwen-Image checkpoint directory")
    parser.add_argument("--kind", choices=("rows", "sequence"), default="rows",
                        help="split each step's rows, or every row's image tokens")
    parser.add_argument("--rows", type=int, default=4, help="requests in the step (with --cfg, two rows each)")
    parser.add_argument("--size", default="512x512", help="image size, WIDTHxHEIGHT")
    parser.add_argument("--cfg", action="store_true", help="true CFG: a negative prompt row per request")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    width, height = (int(v) for v in args.size.split("x"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        results = {}
        for ranks, threads in ((1, 2), (2, 1)):
            runner, compute = _runner(args.checkpoint, args.kind, ranks, threads)
            works = _works(runner, args.rows, height, width, args.cfg)
            results[ranks] = _timed(compute, works, args.repeats)
            runner.close()
            del runner, compute, works
    finally:
        ray.shutdown()
    (one_ms, one), (two_ms, two) = results[1], results[2]
    diff = max(float((b - a).norm() / a.norm()) for a, b in zip(one, two))
    print(json.dumps({"kind": args.kind, "requests": args.rows, "cfg": args.cfg, "size": args.size,
                      "one_rank_two_threads_ms": round(one_ms, 1), "two_ranks_one_thread_each_ms": round(two_ms, 1),
                      "speedup": round(one_ms / two_ms, 3), "max_relative_difference": diff}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
