"""One decode step of the plain-RoPE decoders (the Qwen3-ASR LLM, the VibeVoice LM), with and without
``PreparedDecoder``, on one thread (docs/prepared.md, docs/benchmarks.md).

Usage: python benchmarks/tools/decoder_step_times.py [--models qwen3_asr,vibevoice] [--batches 1,8] [--keys 300]
[--steps 40]

For each model's ``small`` checkpoint (written under checkpoints/ if missing) and decode batch (every request
``--keys`` tokens into its sequence, the AR engine's contiguous decode KV copy in use, linears packed as the engine
packs them with ``gemv_max_rows: 2``), the median time of ``adapter.run`` (the decoder's layers and final norm over
the paged cache; not the head, sampling or engine bookkeeping) with transformers' layers (``library``) and with
``PreparedDecoder`` (``prepared``, the engine's default). Best of three rounds, the two interleaved so machine drift
hits them alike. Qwen2.5-Omni's thinker and talker: benchmarks/qwen2_5_omni/decoder_step_times.py.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from omni_kernels import pack_linears

from omni_serve.engines.ar.attention import PagedBatch
from omni_serve.engines.ar.decode_kv import DecodeKV
from omni_serve.engines.ar.kv_cache import PagedKVCache


def adapters(model: str):
    """(adapter class, its decoder given an adapter) of ``model``."""
    if model == "qwen3_asr":
        from omni_serve.models.qwen3_asr import Qwen3ASRLM

        return Qwen3ASRLM, lambda a: a.model
    from omni_serve.models.vibevoice import VibeVoiceLM

    return VibeVoiceLM, lambda a: a.model.language_model


def checkpoint(model: str) -> str:
    from omni_serve.graph.registry import families, import_path

    path = os.path.join("checkpoints", f"{model}-small")
    if not os.path.exists(os.path.join(path, "omni_serve_checkpoint.json")):
        import_path(families()[model].checkpoint_writer)(path, "small")
    return path


def load(cls, path: str, prepared: bool):
    adapter = cls(path, prepared_layers=prepared)
    for module in adapter.modules.values():
        pack_linears(module, 32, plain_max_rows=2)
    return adapter


def step_ms(adapter, decoder, width: int, positions, batch: int, keys: int, steps: int) -> float:
    """Median ms of ``adapter.run(decoder, ...)`` over ``steps`` decode steps of ``batch`` requests ``keys`` tokens
    into their sequences (the first 5 steps not counted); ``positions(key)``: one request's positions at ``key``."""
    blocks = batch * (keys + steps) // 16 + batch
    cache = PagedKVCache(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, blocks, 16, torch.float32, "cpu")
    copy = DecodeKV(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, torch.float32, "cpu", 256 << 20)
    span = keys + steps + 16
    rows = torch.randn(batch, width)
    times = []
    for i in range(steps):
        segments = [(f"r{b}", 1, torch.tensor([b * span + keys + i]), torch.arange(b * span, b * span + keys + i + 1))
                    for b in range(batch)]
        paged = PagedBatch.build(cache, segments, copy)
        at = positions(keys + i).repeat(1, batch)
        start = time.perf_counter()
        with torch.inference_mode():
            adapter.run(decoder, rows, at, paged)
        times.append(time.perf_counter() - start)
    times = sorted(times[5:])
    return times[len(times) // 2] * 1000


def plain_rope(key: int) -> torch.Tensor:
    return torch.tensor([[key]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3_asr,vibevoice")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{'model':<10} {'batch':>5} {'library ms':>11} {'prepared ms':>12} {'speed-up':>9}")
    for model in args.models.split(","):
        cls, decoder = adapters(model)
        path = checkpoint(model)
        loaded = {prepared: load(cls, path, prepared) for prepared in (False, True)}
        for batch in map(int, args.batches.split(",")):
            best = {prepared: float("inf") for prepared in loaded}
            for _ in range(3):  # interleaved rounds
                for prepared, a in loaded.items():
                    best[prepared] = min(best[prepared], step_ms(a, decoder(a), a.row_size, plain_rope, batch,
                                                                  args.keys, args.steps))
            print(f"{model:<10} {batch:>5} {best[False]:>11.2f} {best[True]:>12.2f} {best[False] / best[True]:>8.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
