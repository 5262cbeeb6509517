"""Two ranks against one: Qwen-Image's DiT forward with its rows split over two gloo ranks of one thread each,
against one process with two threads, on the same rows (``omni_serve.parallel.rows``).

Contract: ``python -m omni_serve.bench.parallel --checkpoint DIR [--rows 4] [--grid 16x16] [--repeats 5]`` prints
one JSON line: the median milliseconds of a forward each way, their ratio, and the largest relative difference
between the two results. Both sides use the machine's two cores; the ranks pay an all-gather and run their
shares as smaller batches, so on a 2-core CPU expect little gain: the point is the cost of the split, which a
GPU per rank turns into a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _inputs(checkpoint: str, rows: int, grid: tuple[int, int]):
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(checkpoint, subfolder="transformer").eval()
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, grid[0] * grid[1], model.config.in_channels, generator=g)
    text = torch.randn(rows, 24, model.config.joint_attention_dim, generator=g)
    mask = torch.ones(rows, 24, dtype=torch.bool)
    timestep = torch.linspace(0.2, 0.9, rows)
    return model, hidden, text, mask, timestep


def _forward(model, hidden, text, mask, timestep, grid, idx):
    with torch.no_grad():
        return model(hidden_states=hidden[idx], encoder_hidden_states=text[idx], encoder_hidden_states_mask=mask[idx],
                     timestep=timestep[idx], img_shapes=[[(1, *grid)]] * len(idx), return_dict=False)[0]


def _timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, out


def _rank(rank: int, port: int, args, queue) -> None:
    from omni_serve.parallel.rows import row_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model, *rest = _inputs(args.checkpoint, args.rows, args.grid)

        def step():
            out = row_parallel(lambda idx: _forward(model, *rest, args.grid, idx), torch.arange(args.rows))
            dist.barrier()
            return out
        ms, out = _timed(step, args.repeats)
        queue.put((rank, ms, out.numpy().copy()))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_serve.bench.parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a Qwen-Image checkpoint directory")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--grid", default="16x16", help="latent patch grid, ROWSxCOLS (16x16: a 512x512 image)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    args.grid = tuple(int(v) for v in args.grid.split("x"))
    torch.set_num_threads(2)
    model, *rest = _inputs(args.checkpoint, args.rows, args.grid)
    one_ms, one = _timed(lambda: _forward(model, *rest, args.grid, torch.arange(args.rows)), args.repeats)
    del model
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    two_ms = max(ms for _, ms, _ in results)
    diff = max(float((torch.from_numpy(out) - one).norm() / one.norm()) for _, _, out in results)
    print(json.dumps({"rows": args.rows, "grid": list(args.grid), "one_rank_two_threads_ms": round(one_ms, 1),
                      "two_ranks_one_thread_each_ms": round(two_ms, 1), "speedup": round(one_ms / two_ms, 3),
                      "max_relative_difference": diff}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
