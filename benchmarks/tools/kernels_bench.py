"""omni_kernels against their references at the shapes the served `small` checkpoints run (docs/benchmarks.md).

Usage: python benchmarks/tools/kernels_bench.py [--threads 1,2] [--reps 300]

Per kernel and shape: microseconds per call of the reference and of the kernel, their ratio and the largest
absolute difference. Shapes: the Qwen2.5-Omni thinker (hidden 512, MLP 1536, 8 query / 4 key heads of 64) and
talker (hidden 384, MLP 1024, 8 / 4 heads of 48) at decode batches 1-32 and a 256-row prefill chunk; the code2wav
DiT's MLP up-projection with its tanh-GELU fused (``PackedLinear(activation="gelu_tanh")``, 2 x 240 rows, 256 -> 512,
float32 and bfloat16) against the linear layer then GELU in the same dtype; at 1-2 rows, the packed product against
``PackedLinear(plain_max_rows=2)``, which runs those rows as MKL matrix-vector products (the AR engine's
``gemv_max_rows``). Run it on a quiet machine: it times one call at a time. It prints the CPU's capability first
(``omni_kernels.cpu_capability()``); rows of a dtype whose prepacked product this CPU lacks (bfloat16 without AVX-512
or AVX-NE-CONVERT) are printed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

from omni_kernels import (PackedLinear, cpu_capability, decode_attention, decode_bias, packing_supported,
                          packing_unsupported_reason, reference_decode_attention, reference_linear,
                          reference_linear_gelu)

LINEARS = [  # (what, rows, in, out)
    ("thinker mlp up", 1, 512, 1536), ("thinker mlp up", 8, 512, 1536), ("thinker mlp up", 32, 512, 1536),
    ("thinker mlp down", 32, 1536, 512), ("thinker q", 32, 512, 512), ("thinker prefill up", 256, 512, 1536),
    ("talker mlp up", 2, 384, 1024), ("talker mlp up", 8, 384, 1024), ("talker q", 8, 384, 384),
]
FUSED_GELU = [("code2wav dit mlp up", 480, 256, 512)]  # (what, rows, in, out), float32 and bfloat16
ATTENTION = [  # (what, batch, heads, kv heads, keys, head dim)
    ("thinker", 1, 8, 4, 60, 64), ("thinker", 32, 8, 4, 120, 64), ("talker", 2, 8, 4, 250, 48),
    ("talker", 8, 8, 4, 250, 48),
]


def timed(fn, reps: int) -> float:
    for _ in range(max(10, reps // 10)):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print("cpu:", cpu_capability().as_dict())
    print(f"{'kernel':<16} {'shape':<34} {'threads':>7} {'reference us':>12} {'kernel us':>10} {'speed-up':>8} "
          f"{'max |diff|':>10}")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        with torch.inference_mode():
            for what, rows, n_in, n_out in LINEARS:
                linear = torch.nn.Linear(n_in, n_out, bias=False)
                x = torch.randn(rows, n_in, generator=gen)
                packed = PackedLinear(linear, batch_hint=32)
                ref = timed(lambda: reference_linear(x, linear.weight), args.reps)
                got = timed(lambda: packed(x), args.reps)
                diff = (packed(x) - reference_linear(x, linear.weight)).abs().max().item()
                print(f"{'packed_linear':<16} {f'{what} {rows}x{n_in}->{n_out}':<34} {threads:>7} {ref:>12.1f} "
                      f"{got:>10.1f} {ref / got:>7.2f}x {diff:>10.1e}")
                if rows <= 2:  # reference: the packed product alone
                    gemv = PackedLinear(torch.nn.Linear(n_in, n_out, bias=False), batch_hint=32, plain_max_rows=2)
                    gemv.packed_weight, gemv.plain_weight = packed.packed_weight, linear.weight
                    got = timed(lambda: gemv(x), args.reps)
                    diff = (gemv(x) - packed(x)).abs().max().item()
                    print(f"{'packed+gemv':<16} {f'{what} {rows}x{n_in}->{n_out}':<34} {threads:>7} "
                          f"{timed(lambda: packed(x), args.reps):>12.1f} {got:>10.1f} "
                          f"{timed(lambda: packed(x), args.reps) / got:>7.2f}x {diff:>10.1e}")
            for (what, rows, n_in, n_out), dtype in itertools.product(FUSED_GELU, (torch.float32, torch.bfloat16)):
                if not packing_supported(dtype):
                    print(f"{'linear+gelu':<16} {what} {dtype}: skipped ({packing_unsupported_reason(dtype)})")
                    continue
                linear = torch.nn.Linear(n_in, n_out).to(dtype)
                x = torch.randn(rows, n_in, generator=gen).to(dtype)
                fused = PackedLinear(linear, batch_hint=256, activation="gelu_tanh")

                def two_ops():
                    return reference_linear_gelu(x, linear.weight, linear.bias)
                ref, got = timed(two_ops, args.reps), timed(lambda: fused(x), args.reps)
                diff = (fused(x).float() - two_ops().float()).abs().max().item()
                shape = f"{what} {rows}x{n_in}->{n_out} {str(dtype).split('.')[-1]}"
                print(f"{'linear+gelu':<16} {shape:<34} {threads:>7} {ref:>12.1f} {got:>10.1f} {ref / got:>7.2f}x "
                      f"{diff:>10.1e}")
            for what, batch, heads, kv_heads, keys, dim in ATTENTION:
                q = torch.randn(batch, heads, dim, generator=gen)
                k, v = (torch.randn(batch, kv_heads, keys, dim, generator=gen) for _ in range(2))
                lengths = torch.randint(keys // 2, keys + 1, (batch,), generator=gen)
                lengths[0] = keys
                bias = decode_bias(lengths, keys)
                ref = timed(lambda: reference_decode_attention(q, k, v, bias), args.reps)
                got = timed(lambda: decode_attention(q, k, v, bias), args.reps)
                diff = (decode_attention(q, k, v, bias) - reference_decode_attention(q, k, v, bias)).abs().max().item()
                shape = f"{what} B={batch} H={heads}/{kv_heads} L={keys} d={dim}"
                print(f"{'decode_attention':<16} {shape:<34} {threads:>7} {ref:>12.1f} {got:>10.1f} {ref / got:>7.2f}x "
                      f"{diff:>10.1e}")


if __name__ == "__main__":
    main()
