"""One decode step of Qwen2.5-Omni's thinker and talker decoders, three ways, on one thread (docs/benchmarks.md).

Usage: python benchmarks/qwen2_5_omni/decoder_step_times.py [CHECKPOINT] [--batches 1,2,4,16] [--keys 300] [--steps 40]

For each decoder and decode batch (every request ``--keys`` tokens into its sequence, the AR engine's contiguous
decode KV copy in use), the median time of ``adapter.run`` (the decoder's layers and final norm over the paged
cache; not the head, sampling or engine bookkeeping) with:
- ``packed``: transformers' layers, linears prepacked for oneDNN (the AR engine before gemv_max_rows);
- ``packed+gemv``: the same with ``plain_max_rows=2`` (``ARConfig.gemv_max_rows``: 1-2 rows through MKL's gemv);
- ``prepared``: ``PreparedDecoder`` (the engine's default now) with ``plain_max_rows=2``.
Best of three rounds, the three configurations interleaved so machine drift hits them alike. Run it on a quiet
machine.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from omni_kernels import pack_linears

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.tools.decoder_step_times import step_ms as decoder_step_ms  # noqa: E402
from omni_serve.models import qwen2_5_omni as omni  # noqa: E402


def load(cls, checkpoint: str, prepared: bool, plain_max_rows: int):
    adapter = cls(checkpoint, prepared_layers=prepared)
    for module in adapter.modules.values():
        pack_linears(module, 32, plain_max_rows=plain_max_rows)
    return adapter


def step_ms(adapter, batch: int, keys: int, steps: int) -> float:
    thinker = isinstance(adapter, omni.OmniThinker)
    decoder = adapter.model if thinker else adapter.model.model
    width = adapter.row_size if thinker else adapter.config.hidden_size
    positions = (lambda key: adapter.step_positions(key, 0, 1)) if thinker else (lambda key: adapter.positions(key, 1))
    return decoder_step_ms(adapter, decoder, width, positions, batch, keys, steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", nargs="?", default="checkpoints/qwen2_5_omni-small")
    ap.add_argument("--batches", default="1,2,4,16")
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    configs = {"packed": (False, 0), "packed+gemv": (False, 2), "prepared": (True, 2)}
    print(f"{'decoder':<8} {'batch':>5} " + " ".join(f"{name + ' ms':>15}" for name in configs) + f" {'speed-up':>9}")
    for cls, name in ((omni.OmniThinker, "thinker"), (omni.OmniTalker, "talker")):
        adapters = {c: load(cls, args.checkpoint, *spec) for c, spec in configs.items()}
        for batch in map(int, args.batches.split(",")):
            best = {c: float("inf") for c in adapters}
            for _ in range(3):  # interleaved rounds
                for c, a in adapters.items():
                    best[c] = min(best[c], step_ms(a, batch, args.keys, args.steps))
            print(f"{name:<8} {batch:>5} " + " ".join(f"{best[c]:>15.2f}" for c in configs)
                  + f" {best['packed'] / best['prepared']:>8.2f}x")


if __name__ == "__main__":
    main()
