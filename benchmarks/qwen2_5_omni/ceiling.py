"""The Qwen2.5-Omni graph's compute ceiling on this machine (quoted in docs/benchmarks.md).

Each stage's cost per request, alone, in process, on one torch thread (every stage of the benchmark's graph runs
one), at batch 1 and at the benchmark's concurrency, for the benchmark's request shape (a chat prompt, 32 text
tokens, 384 codec tokens, 10 DiT steps):

- ``thinker``: prefill of a benchmark prompt and 32 decode steps on the AR engine, B requests at once;
- ``talker``: prefill of the thinker prompt's length and 384 decode steps on the AR engine, B at once (random
  thinker-sized input rows: the cost does not depend on their values);
- ``code2wav``: B requests' codec streams through the served stage's chunking (first chunk of 12 codes, then 96,
  12 codes of context on each side), the windows of all B solved in one packed DiT call (first windows apart),
  then the vocoder, as the stage's batch engine does.

With every stage single-threaded, the best the graph can do on ``--cores`` cores is
``cores / sum(per-request cost at the best batch)`` requests/s, and no faster than any stage allows on its replicas
(``replicas / cost``; code2wav has ``--code2wav-replicas``). transformers' ``generate`` one request at a time on
two threads (the benchmark's baseline) gives the ratio that ceiling allows. ``--bench-report`` reads an
``omni-serve bench`` report and prints each engine run's requests/s as a fraction of the ceiling.

    python benchmarks/qwen2_5_omni/ceiling.py [checkpoints/qwen2_5_omni-small] [--batch 16] [--dit-dtype float32]
        [--bench-report bench_out/omni/bench_report.json] [--out ceiling.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.tools.ceiling_report import against_bench, ar_seconds_per_request, print_costs, write_report

from omni_serve.engines.ar import ARConfig, ARSequence
from omni_serve.families.qwen2_5_omni.messages import CodecChunk
from omni_serve.families.qwen2_5_omni.replica.code2wav import Code2WavCompute, Code2WavRequest, Code2WavStream
from omni_serve.models.qwen2_5_omni import OmniCode2Wav, OmniTalker, OmniThinker


class Rows(ARSequence):
    """A request of ``prompt`` random input rows that then decodes ``steps`` tokens, each next row random."""

    def __init__(self, model, prompt: int, steps: int, seed: int):
        width = model.row_size if hasattr(model, "row_size") else model.embedding_size
        super().__init__(width, model.position_rows)
        self.gen = torch.Generator().manual_seed(seed)
        self.steps_left = steps
        self.max_rows = prompt + steps + 1
        self._add(prompt)

    def _add(self, n: int) -> None:
        start = self.num_rows
        rows = torch.randn(n, self._emb.shape[1], generator=self.gen) * 0.02
        self.append(rows, torch.arange(start, start + n).view(1, n).expand(self._pos.shape[0], n))

    def on_computed(self, start, end, hidden, logits):
        if logits is None:
            return []
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.done = True
        else:
            self._add(1)
        return []


def ar_stage_seconds(model, prompt: int, steps: int, batch: int) -> float:
    config = ARConfig(max_num_seqs=max(batch, 1), num_kv_blocks=max(512, batch * ((prompt + steps) // 16 + 2)))
    return ar_seconds_per_request(model, config, lambda i: Rows(model, prompt, steps, i), batch,
                                  range(1000, 1000 + min(batch, 4)))


def run_code2wav_streams(model: OmniCode2Wav, compute: Code2WavCompute, n: int, codes: int, steps: int,
                         gen: torch.Generator) -> None:
    """``n`` requests of ``codes`` random codes, fed whole, stepped as the batch engine steps them."""
    streams = []
    for i in range(n):
        stream = Code2WavStream(model, Code2WavRequest("Chelsie", i, steps))
        stream.feed(CodecChunk(codes=torch.randint(0, 8000, (codes,), generator=gen).tolist(), end=True))
        streams.append(stream)
    with torch.inference_mode():
        while any(s.ready() for s in streams):
            groups: dict[tuple, list] = {}
            for s in streams:
                if s.ready():
                    key, job = s.work()
                    groups.setdefault(key, []).append((s, job))
            for members in groups.values():
                for (s, _), result in zip(members, compute([job for _, job in members])):
                    s.complete(result)


def code2wav_seconds_per_request(model: OmniCode2Wav, codes: int, batch: int, steps: int) -> float:
    compute = Code2WavCompute(model, steps, 0.5, -1.0)
    gen = torch.Generator().manual_seed(0)
    run_code2wav_streams(model, compute, 1, codes, steps, gen)  # warm-up
    start = time.perf_counter()
    run_code2wav_streams(model, compute, batch, codes, steps, gen)
    return (time.perf_counter() - start) / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default="checkpoints/qwen2_5_omni-small")
    parser.add_argument("--batch", type=int, default=16, help="the best batch (the benchmark's concurrency)")
    parser.add_argument("--prompt-tokens", type=int, default=40, help="thinker prompt length (the bench's ~30-60)")
    parser.add_argument("--text-tokens", type=int, default=32)
    parser.add_argument("--codec-tokens", type=int, default=384)
    parser.add_argument("--steps", type=int, default=10, help="DiT ODE steps")
    parser.add_argument("--dit-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--code2wav-replicas", type=int, default=2)
    parser.add_argument("--bench-report", help="an `omni-serve bench` report to set against the ceiling")
    parser.add_argument("--out", help="write the table as JSON here too")
    args = parser.parse_args()
    torch.set_num_threads(1)
    thinker, talker = OmniThinker(args.checkpoint), OmniTalker(args.checkpoint)
    code2wav = OmniCode2Wav(args.checkpoint, dit_dtype=getattr(torch, args.dit_dtype))
    costs: dict[str, dict[int, float]] = {}
    for batch in sorted({1, args.batch}):
        costs.setdefault("thinker", {})[batch] = ar_stage_seconds(thinker, args.prompt_tokens,
                                                                        args.text_tokens, batch)
        costs.setdefault("talker", {})[batch] = ar_stage_seconds(talker, args.prompt_tokens + 2,
                                                                       args.codec_tokens, batch)
        costs.setdefault("code2wav", {})[batch] = code2wav_seconds_per_request(code2wav, args.codec_tokens, batch,
                                                                               args.steps)
    best = {stage: min(by_batch.values()) for stage, by_batch in costs.items()}
    replicas = {"thinker": 1, "talker": 1, "code2wav": args.code2wav_replicas}
    total = sum(best.values())
    bounds = {"cores": args.cores / total, **{s: replicas[s] / c for s, c in best.items()}}
    ceiling = min(bounds.values())
    print(f"per-request seconds on one thread ({args.text_tokens} text tokens, {args.codec_tokens} codec tokens, "
          f"{args.steps} DiT steps, DiT {args.dit_dtype})")
    print_costs(costs, args.batch, total)
    print("bounds (req/s): " + ", ".join(f"{k} {v:.3f}" for k, v in bounds.items()))
    print(f"ceiling: {ceiling:.3f} req/s ({min(bounds, key=bounds.get)} bound)")
    report = {"costs_s_per_request": costs, "best_s_per_request": best, "bounds_req_per_s": bounds,
              "ceiling_req_per_s": ceiling, "settings": vars(args)}
    if args.bench_report:
        report["bench"] = against_bench(args.bench_report, ceiling, "requests_per_s", "hf")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
