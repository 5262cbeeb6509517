"""The VibeVoice speech graph's compute ceiling on this machine (quoted in docs/benchmarks.md#vibevoice-speech).

The lm stage does all of a request's model work: per speech token the LM step, the negative branch and token-CFG
passes, the diffusion head (10 steps, CFG), the acoustic decode of one frame and the semantic encode of its audio.
Its cost per speech token, alone, in process, on one torch thread, is timed through the served code: B of the
benchmark's requests (its seeded texts, the preset voice, the served ``max_speech_seconds`` worth of tokens: the
small checkpoint's random LM speaks until then) as ``SpeakSequence`` programs fed their voice clip, run together on
the AR engine with the serve config's ``engine.ar`` and ``params`` (prefill, voices' encode and every token), for B in
``--batches`` (default 1, a replica's share of the benchmark's concurrency, and the concurrency), the least of
``--repeats`` runs (default 2: a shared machine only slows a run down). The ingress' own
CPU per token is timed too: the prompt (template, voice expansion, tokenizer) per request spread over its tokens, and
each token's 3200 samples encoded to pcm; the HTTP and Ray messaging around it are not counted.

A speech token is 3200 samples at 24 kHz: 0.1333 s of audio. With R lm replicas of T threads, C requests in flight
are split over the replicas, a batch of B = ceil(C / R) each; the ceiling at concurrency C, in audio seconds per
second: ``min(cores / (lm(B) + ingress), min(R, C) * T / lm(B)) * 0.1333`` (the cores kept busy; no faster than
the threads of the lm replicas that have a request allow). Both assume perfect scaling over threads, so it is an
upper bound. ``--bench-report`` reads an ``omni-serve bench --graph vibevoice --mode speech`` report (run.sh runs this
script after its own) and sets each engine point against the ceiling of its concurrency, and the ceiling against the
report's transformers baseline.

    python benchmarks/vibevoice/ceiling.py [checkpoints/vibevoice-small] [--config benchmarks/vibevoice/small.yaml]
        [--batch 8] [--batches 1,4,8] [--voice alice] [--tokens N] [--cores 2] [--repeats 2]
        [--bench-report bench_out/vibevoice/speech_bench_report.json] [--out ceiling.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time

import torch
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.tools.ceiling_report import timed, write_report
from benchmarks.vibevoice.baseline import preset_clip

from omni_serve.api.speech_audio import SpeechEncoder
from omni_serve.bench.speech import SpeechBenchConfig
from omni_serve.families.vibevoice.messages import SpeakCall, VoiceClips
from omni_serve.families.vibevoice.replica.programs import SpeakSequence
from omni_serve.families.vibevoice.spec import VibeVoiceGraphSpec
from omni_serve.models.vibevoice_prompt import parse_script, prompt_ids, speakers_of, voice_frames

SAMPLE_RATE, HOP = 24000, 3200
TOKEN_S = HOP / SAMPLE_RATE  # audio seconds per speech token


def load_spec(config: str, checkpoint: str) -> VibeVoiceGraphSpec:
    with open(config) as f:
        return VibeVoiceGraphSpec(**{**(yaml.safe_load(f) or {}), "checkpoint": checkpoint})


def served_tokens(spec: VibeVoiceGraphSpec) -> int:
    return math.ceil(spec.max_speech_seconds * SAMPLE_RATE / HOP)


def calls(processor, texts: list[str], clip, tokens: int, seed: int = 0) -> list[SpeakCall]:
    """The lm stage's calls of the bench's texts, as the ingress builds them."""
    out = []
    for i, text in enumerate(texts):
        turns = parse_script(text)
        ids = prompt_ids(processor, turns, {s: voice_frames(clip.size, HOP) for s in speakers_of(turns)})
        out.append(SpeakCall(request_id=f"r{i}", input_ids=ids, speakers=speakers_of(turns), seed=seed + i,
                             max_new_tokens=tokens))
    return out


def lm_seconds_per_token(model, spec: VibeVoiceGraphSpec, groups: list[list[SpeakCall]], clip, tokens: int) -> float:
    """Seconds per speech token of a group of calls run together on the AR engine (one torch thread), after one short
    unmeasured request: the least over ``groups`` (runs of other texts, so no prefix-cache hit; a shared machine
    only ever makes a run slower)."""
    from omni_serve.engines.ar import AREngine

    ar = spec.stage_spec("lm").engine.ar
    voice = VoiceClips(clips=[torch.from_numpy(clip)])

    async def main() -> float:
        engine = AREngine("lm", model, ar, torch_threads=1)
        await engine.start()

        async def one(call: SpeakCall) -> int:
            seq = SpeakSequence(model, call)
            seq.feed(voice)
            n = 0
            async for _ in engine.generate(call.request_id, seq):
                n += 1
            return n
        try:
            await one(groups[0][0].model_copy(update={"request_id": "warm", "max_new_tokens": 4}))
            best = math.inf
            for todo in groups:
                start = time.perf_counter()
                await asyncio.gather(*(one(c) for c in todo))
                best = min(best, (time.perf_counter() - start) / (len(todo) * tokens))
            return best
        finally:
            await engine.cleanup()
    return asyncio.run(main())


def ingress_seconds_per_token(processor, text: str, clip, tokens: int) -> float:
    samples = torch.randn(HOP).clamp(-1, 1).numpy()

    def prompt():
        turns = parse_script(text)
        prompt_ids(processor, turns, {s: voice_frames(clip.size, HOP) for s in speakers_of(turns)})

    def encode():
        enc = SpeechEncoder("pcm", SAMPLE_RATE, 1.0, streaming=True)
        for _ in range(tokens):
            enc.feed(samples)
        enc.close()
    return (timed(prompt) + timed(encode)) / tokens


def against_report(path: str, ceiling_of) -> dict:
    """Each engine point of a speech bench report against the ceiling of its concurrency (``ceiling_of(c)``); the
    ceiling at the largest one over the hf baseline."""
    with open(path) as f:
        report = json.load(f)
    out = {}
    engine = [row for row in report["points"] if row["system"] == "engine" and not row.get("request_rate")]
    for row in engine:
        value, c = row["audio_s_per_s"], row["concurrency"]
        ceiling = ceiling_of(c)
        out[f"engine_c{c}"] = {"audio_s_per_s": value, "ceiling_audio_s_per_s": ceiling,
                               "measured_over_ceiling": value / ceiling}
        print(f"bench: engine c={c} {value:.3f} audio s/s = {value / ceiling:.2f} of its ceiling ({ceiling:.3f})")
    for row in report["points"]:
        if row["system"] == "hf" and engine and row["audio_s_per_s"]:
            top = max(row_["concurrency"] for row_ in engine)
            ratio = ceiling_of(top) / row["audio_s_per_s"]
            out["hf"] = {"audio_s_per_s": row["audio_s_per_s"], f"ceiling_c{top}_over_hf": ratio}
            print(f"bench: hf {row['audio_s_per_s']:.3f} audio s/s -> the c={top} ceiling is {ratio:.2f}x it")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default="checkpoints/vibevoice-small")
    parser.add_argument("--config", default="benchmarks/vibevoice/small.yaml",
                        help="the serve config (max_speech_seconds, the lm stage's threads, engine.ar, params)")
    parser.add_argument("--batch", type=int, default=8, help="the largest batch (the benchmark's concurrency)")
    parser.add_argument("--batches", default=None, help="batches to time, comma-separated (default: 1 and --batch)")
    parser.add_argument("--voice", default="alice")
    parser.add_argument("--tokens", type=int, default=None,
                        help="speech tokens per request (default: the served max_speech_seconds'; fewer is quicker "
                             "and, the KV cache being shorter, a little cheaper per token)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per batch; the least counts (default 2)")
    parser.add_argument("--bench-report", help="an `omni-serve bench --graph vibevoice --mode speech` report")
    parser.add_argument("--out", help="write the table as JSON here too")
    args = parser.parse_args()
    from transformers import AutoProcessor

    from omni_serve.models.vibevoice import VibeVoiceLM

    spec = load_spec(args.config, args.checkpoint)
    lm_spec = spec.stage_spec("lm")
    ar = lm_spec.engine.ar
    tokens = args.tokens or served_tokens(spec)
    replicas = lm_spec.num_replicas or 1
    batches = sorted({int(b) for b in args.batches.split(",")} if args.batches
                     else {1, math.ceil(args.batch / replicas), args.batch})
    torch.set_num_threads(1)
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    clip = preset_clip(args.checkpoint, args.voice, spec.voices_dir)
    top = max(batches)
    texts = SpeechBenchConfig(url="http://unused", graph="vibevoice", num_requests=top * args.repeats,
                              baseline="none", calibrate=False).texts()  # the benchmark's texts (seed 0), and more
    todo = calls(processor, texts, clip, tokens)
    model = VibeVoiceLM(args.checkpoint, branch_kv_blocks=max(2, round(ar.num_kv_blocks *
                                                                       lm_spec.params.branch_kv_factor)),
                        branch_block_size=ar.block_size)
    lm = {b: lm_seconds_per_token(model, spec, [todo[k * top:k * top + b] for k in range(args.repeats)], clip, tokens)
          for b in batches}
    ingress = ingress_seconds_per_token(processor, texts[0], clip, tokens)
    threads = lm_spec.engine.torch_threads

    def batch_of(c: int) -> int:
        """A replica's batch at concurrency ``c`` (the nearest timed batch at or below it)."""
        share = math.ceil(c / replicas)
        return max([b for b in batches if b <= share] or [min(batches)])

    def limits(c: int) -> dict[str, float]:
        b, busy = batch_of(c), min(replicas, c)  # replicas with a request
        return {"cores": args.cores / (lm[b] + ingress) * TOKEN_S,
                f"lm ({busy} x {threads} thread{'s' * (threads > 1)})": busy * threads / lm[b] * TOKEN_S}

    def ceiling_of(c: int) -> float:
        return min(limits(c).values())

    print(f"seconds per speech token on one thread ({tokens} tokens a request, {TOKEN_S:.4f} s of audio each; "
          f"voice {args.voice}, {clip.size / SAMPLE_RATE:.2f} s)")
    print(f"{'stage':<9}" + "".join(f"{f'batch {b}':>10}" for b in batches))
    print(f"{'lm':<9}" + "".join(f"{lm[b]:>10.4f}" for b in batches))
    print(f"{'ingress':<9}" + "".join(f"{ingress:>10.5f}" for _ in batches))
    points = sorted({1, args.batch})
    for c in points:
        print(f"ceiling at concurrency {c} (batch {batch_of(c)} per replica): min("
              + ", ".join(f"{k} {v:.2f}" for k, v in limits(c).items()) + f") = {ceiling_of(c):.3f} s of audio per s")
    report = {"tokens_per_request": tokens, "token_audio_s": TOKEN_S, "cores": args.cores, "lm_replicas": replicas,
              "lm_threads": threads, "lm_s_per_token": lm, "ingress_s_per_token": ingress,
              "lm_batch_speedup": {b: lm[min(batches)] / lm[b] for b in batches},
              "limits_audio_s_per_s": {c: limits(c) for c in points},
              "ceiling_audio_s_per_s": {c: ceiling_of(c) for c in points}}
    if args.bench_report:
        report["bench"] = against_report(args.bench_report, ceiling_of)
    write_report(args.out, report)


if __name__ == "__main__":
    main()
