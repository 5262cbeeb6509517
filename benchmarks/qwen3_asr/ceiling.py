"""The Qwen3-ASR transcription graph's compute ceiling on this machine (quoted in
docs/benchmarks.md#qwen3-asr-transcription).

Each stage's cost per request, alone, in process, on one torch thread, for the benchmark's requests (its seeded clips
of --audio-seconds, the language forced, --max-tokens tokens per window: the small checkpoint's random weights never
write a stop token), through the served graph's own code:

- ``ingress``: what the ingress does for a request on its CPU: the WAV decoded (the server's decoder), the windows
  cut (``split_windows``), each window's prompt and log-mel (``WindowPrompts.window``: the processor's), and the
  transcript decoded as the tokens arrive (``TranscriptText``, one token at a time, then its final parse); not
  batched; the HTTP and Ray messaging around it are not counted;
- ``encoder``: one ``Qwen3ASREncoder.encode`` call over B requests' windows;
- ``llm``: B requests' ``TranscribeSequence`` programs (their audio embeddings fed) run together on the AR engine
  with the serve config's ``engine.ar`` settings (prefill + one decode step per token).

At batch 1 and each power of two up to ``--batch`` (the benchmark's concurrency), the best batch being the cheapest
per request. The ceiling: the cores kept busy with each stage at its best batch, ``cores / sum(best)`` requests/s,
and no faster than one stage allows with the threads the serve config gives it (``threads / best``: the stages run
one replica each; the ingress one thread: its CPU work holds the GIL). Both assume perfect scaling over threads, so
the ceiling is an upper bound. ``--bench-report`` reads an ``omni-serve bench --mode transcription`` report (run.sh
runs this script after its own) and prints each engine run as a fraction of the ceiling and the ceiling's ratio to
the run's transformers baseline.

    python benchmarks/qwen3_asr/ceiling.py [checkpoints/qwen3_asr-small] [--audio-seconds 10] [--max-tokens 40]
        [--batch 8] [--config benchmarks/qwen3_asr/small.yaml]
        [--bench-report bench_out/qwen3_asr/transcription_bench_report.json] [--out ceiling.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.tools.ceiling_report import against_bench, ar_seconds_per_request, timed, write_report

from omni_serve.api.media import decode_audio_bytes
from omni_serve.bench.transcription import SAMPLE_RATE, TranscriptionBenchConfig, build_transcription_workload
from omni_serve.families.qwen3_asr.messages import AudioEmbeds, TranscribeCall
from omni_serve.families.qwen3_asr.prompting import WindowPrompts, split_windows
from omni_serve.families.qwen3_asr.replica.programs import TranscribeSequence
from omni_serve.families.qwen3_asr.spec import Qwen3ASRGraphSpec
from omni_serve.models.qwen3_asr import Qwen3ASREncoder, Qwen3ASRLM

STAGES = ("encoder", "llm")


def load_spec(config: str, checkpoint: str) -> Qwen3ASRGraphSpec:
    with open(config) as f:
        return Qwen3ASRGraphSpec(**{**(yaml.safe_load(f) or {}), "checkpoint": checkpoint})


def stage_threads(config: str) -> dict[str, int]:
    """Each stage's torch threads in the serve config (its defaults where the file names none)."""
    spec = load_spec(config, "unused")
    return {stage: spec.stage_spec(stage).engine.torch_threads for stage in STAGES}


def windows_of(prompts: WindowPrompts, wav: bytes, spec: Qwen3ASRGraphSpec, language: str | None):
    """The request's windows as the ingress builds them: ``[(input_ids, features, frames), ...]``."""
    audio = decode_audio_bytes(wav, "wav", target_sr=SAMPLE_RATE, max_seconds=spec.max_audio_seconds, param="file")
    return [prompts.window(audio[a:b], language, None)
            for a, b in split_windows(audio.size, SAMPLE_RATE, spec.window_seconds, spec.window_search_seconds,
                                      audio)]


def ingress_seconds_per_request(prompts: WindowPrompts, wav: bytes, spec: Qwen3ASRGraphSpec, language: str | None,
                                tokens: list[int]) -> float:
    def run():
        for _ in windows_of(prompts, wav, spec, language):
            text = prompts.decoder(forced=bool(language))
            for t in tokens:
                text.add([t])
            text.flush()
            text.final()
    return timed(run)


def encoder_seconds_per_request(model: Qwen3ASREncoder, windows: list[list[tuple]]) -> float:
    clips = [(feats, frames) for per_request in windows for _, feats, frames in per_request]
    return timed(lambda: model.encode(clips)) / len(windows)


def llm_seconds_per_request(model: Qwen3ASRLM, spec: Qwen3ASRGraphSpec, windows: list[list[tuple]],
                            embeds: list[list[torch.Tensor]], batch: int) -> float:
    """Seconds per request of ``batch`` requests (all their windows) on the AR engine, after as many other ones."""
    ar = spec.stage_spec("llm").engine.ar
    flat = [(ids, e) for per_ids, per_e in zip(windows, embeds) for (ids, _, _), e in zip(per_ids, per_e)]
    per_request = len(flat) // len(windows)

    def program(i: int) -> TranscribeSequence:
        ids, e = flat[i]
        seq = TranscribeSequence(model, TranscribeCall(request_id=str(i), input_ids=ids, max_tokens=spec.max_tokens),
                                 ar.block_size)
        seq.feed(AudioEmbeds(embeds=e))
        return seq
    n = batch * per_request
    return ar_seconds_per_request(model, ar, program, n, range(n, 2 * n)) * per_request


def batches(top: int) -> list[int]:
    return sorted({1, top} | {2 ** k for k in range(top.bit_length()) if 2 ** k <= top})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default="checkpoints/qwen3_asr-small")
    parser.add_argument("--audio-seconds", type=float, default=10.0)
    parser.add_argument("--language", default="en")
    parser.add_argument("--max-tokens", type=int, default=None, help="default: the serve config's max_tokens")
    parser.add_argument("--batch", type=int, default=8, help="the largest batch (the benchmark's concurrency)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--config", default="benchmarks/qwen3_asr/small.yaml",
                        help="the serve config (stage threads, the LLM's engine.ar, windows, max_tokens)")
    parser.add_argument("--bench-report",
                        help="an `omni-serve bench --mode transcription` report to set against the ceiling")
    parser.add_argument("--out", help="write the table as JSON here too")
    args = parser.parse_args()
    spec = load_spec(args.config, args.checkpoint)
    if args.max_tokens is not None:
        spec = spec.model_copy(update={"max_tokens": args.max_tokens})
    language = None if args.language.lower() == "none" else args.language
    # the benchmark's clips (its workload, seed 0), and as many others for the AR engine's warm-up
    cfg = TranscriptionBenchConfig(url="http://unused", num_requests=2 * max(args.batch, 1),
                                   audio_seconds=args.audio_seconds, language=language, baseline="none")
    requests = build_transcription_workload(cfg)
    torch.set_num_threads(1)
    prompts = WindowPrompts(args.checkpoint)
    encoder, llm = Qwen3ASREncoder(args.checkpoint), Qwen3ASRLM(args.checkpoint)
    windows = [windows_of(prompts, r.wav, spec, language) for r in requests]
    with torch.inference_mode():
        embeds = [encoder.encode([(f, n) for _, f, n in per]) for per in windows]
    tokens = list(range(100, 100 + spec.max_tokens))  # the text decoder's work grows with the tokens, not with ids
    ingress = ingress_seconds_per_request(prompts, requests[0].wav, spec, language, tokens)
    costs: dict[str, dict[int, float]] = {stage: {} for stage in STAGES}
    for batch in batches(args.batch):
        with torch.inference_mode():
            costs["encoder"][batch] = encoder_seconds_per_request(encoder, windows[:batch])
        costs["llm"][batch] = llm_seconds_per_request(llm, spec, windows, embeds, batch)
    best_batch = {stage: min(by_batch, key=by_batch.get) for stage, by_batch in costs.items()}
    best = {"ingress": ingress} | {stage: costs[stage][b] for stage, b in best_batch.items()}
    total = sum(best.values())
    threads = stage_threads(args.config)
    limits = {"cores": args.cores / total, "ingress (1 thread)": 1 / ingress} | {
        f"{stage} ({threads[stage]} thread{'s' * (threads[stage] > 1)})": threads[stage] / best[stage]
        for stage in STAGES}
    ceiling = min(limits.values())
    print(f"per-request seconds on one thread ({args.audio_seconds:g} s clips, language {language}, "
          f"{spec.max_tokens} tokens per window, windows of {spec.window_seconds:g} s)")
    columns = batches(args.batch)
    print(f"{'stage':<9}" + "".join(f"{f'batch {b}':>10}" for b in columns) + f"{'best':>10}")
    print(f"{'ingress':<9}" + " " * 10 * len(columns) + f"{ingress:>10.4f}")
    for stage, by_batch in costs.items():
        print(f"{stage:<9}" + "".join(f"{by_batch[b]:>10.4f}" for b in columns) + f"{best[stage]:>10.4f}")
    print(f"{'sum':<9}" + "".join(f"{sum(c[b] for c in costs.values()) + ingress:>10.4f}" for b in columns)
          + f"{total:>10.4f}")
    print("ceiling: min(" + ", ".join(f"{k} {v:.2f}" for k, v in limits.items()) + f") = {ceiling:.2f} requests/s = "
          f"{ceiling * args.audio_seconds:.1f} s of audio per s")
    report = {"costs_s_per_request": costs, "ingress_s_per_request": ingress, "best_batch": best_batch,
              "best_s_per_request": best, "limits": limits, "ceiling_requests_per_s": ceiling,
              "ceiling_audio_s_per_s": ceiling * args.audio_seconds}
    if args.bench_report:
        report["bench"] = against_bench(args.bench_report, ceiling, "requests_per_s", "transformers")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
