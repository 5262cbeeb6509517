"""The vibevoice bench plug-in (VibeVoice text-to-speech behind OpenAI's ``POST /v1/audio/speech`` vs transformers'
``VibeVoiceForConditionalGeneration.generate``): mode ``speech``, ``omni_serve.bench.speech.run_speech_bench``: a
closed loop of ``--num-requests`` seeded texts (``--min-words``-``--max-words`` words, one speaker, the preset
``--voice``, a seed per request: ``--seed`` + its index) streamed as raw pcm at each ``--concurrency`` (default 1,8)
at ``--url`` (TTFP, E2E, RTF, audio seconds per second, what a listening client hears: stalls and the gaps between
chunks), then the same texts, voice clip and seeds through ``generate`` one at a time in process (``--baseline hf``,
the default with ``--checkpoint``; ``baseline.py``) with the served graph's ``--max-speech-seconds`` as its
``max_new_tokens``; the report's ratios are engine / baseline audio seconds per second.

Contract: ``BENCH`` (``omni_serve.bench.plugins``); ``speech_config(args)`` turns the parsed flags into the run's
``omni_serve.bench.speech.SpeechBenchConfig`` (``ValueError`` or pydantic's ``ValidationError`` for a usage error).
Run recipe: ``run.sh`` with ``small.yaml``; the compute ceiling: ``ceiling.py``.
"""

from __future__ import annotations

import logging

from omni_serve.bench import cli as bench_cli
from omni_serve.bench.plugins import BenchPlugin

CHUNK_S = 3200 / 24000  # the audio of one speech token: what the lm stage sends at a time
MODES = {"speech": "POST /v1/audio/speech (TTFP, RTF, audio seconds per second, inter-chunk gaps) vs transformers' "
                   "VibeVoice generate, one request at a time"}


def add_arguments(group) -> None:
    group.add_argument("--voice", default="alice",
                       help="preset voice of every request (a file of the checkpoint's voices/; default alice)")
    group.add_argument("--max-speech-seconds", type=float, default=120.0, metavar="S",
                       help="the served graph's max_speech_seconds: the baseline's max_new_tokens is "
                            "ceil(S * 7.5) (default 120, the graph's default)")
    group.add_argument("--min-words", type=int, default=12, help="shortest text in words (default 12)")
    group.add_argument("--max-words", type=int, default=24, help="longest text in words (default 24)")
    group.add_argument("--baseline-requests", type=int, default=None, metavar="K",
                       help="texts the baseline speaks (default: all of them)")
    group.add_argument("--no-retry", action="store_true",
                       help="count a 429 as rejected instead of sending the request again after its Retry-After")


def speech_config(args):
    from omni_serve.bench.speech import SpeechBenchConfig

    baseline = args.baseline if args.baseline != "auto" else ("hf" if args.checkpoint else "none")
    if baseline == "transformers":
        baseline = "hf"
    if baseline not in ("hf", "none"):
        raise ValueError(f"speech mode baselines are hf (transformers' generate) or none, got {baseline!r}")
    if baseline == "hf" and not args.checkpoint:
        raise ValueError("the hf baseline needs --checkpoint (the served checkpoint)")
    return SpeechBenchConfig(
        url=args.url, graph="vibevoice", checkpoint=args.checkpoint, model=args.model, voice=args.voice,
        num_requests=args.num_requests, concurrency=args.concurrency or [1, 8], request_rate=args.request_rate,
        min_words=args.min_words, max_words=args.max_words, seed=args.seed, warmup=args.warmup, baseline=baseline,
        baseline_requests=args.baseline_requests, max_speech_seconds=args.max_speech_seconds, threads=args.threads,
        stop_server_pid=args.stop_server_pid, out=args.out, timeout_s=args.timeout,
        calibrate=not args.no_calibration, client_buffer_s=args.client_buffer, retry_rejected=not args.no_retry)


def run(args) -> int:
    from pydantic import ValidationError

    from omni_serve.bench.speech import format_report, run_speech_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.url:
        return bench_cli.fail("speech mode needs --url (the running server)")
    try:
        cfg = speech_config(args)
    except (ValidationError, ValueError) as exc:
        return bench_cli.fail(bench_cli.validation_message(exc))
    report = run_speech_bench(cfg, _baseline)
    print(format_report(report))
    for line in stutter_lines(report):
        print(line)
    return 1 if any(row["failed"] for row in report["points"]) else 0


def stutter_lines(report: dict) -> list[str]:
    """Each streamed point's p95 gap between audio chunks against the audio one chunk holds (a speech token's 3200
    samples at 24 kHz): below it, a client that has started playing never runs dry (no stutter)."""
    out = []
    for row in report["points"]:
        gaps = (row.get("playback") or {}).get("chunk_gap_s")
        if row["system"] == "engine" and gaps:
            verdict = "below" if gaps["p95"] < CHUNK_S else "NOT below"
            out.append(f"{row['system']} c={row['concurrency']}: chunk gap p95 {gaps['p95'] * 1000:.0f} ms, "
                       f"{verdict} a chunk's {CHUNK_S * 1000:.0f} ms of audio")
    return out


def _baseline(cfg, texts):
    from benchmarks.vibevoice.baseline import run_baseline

    return run_baseline(cfg, texts)


BENCH = BenchPlugin(family="vibevoice", modes=MODES, add_arguments=add_arguments, run=run)
