"""The qwen3_asr bench plug-in (Qwen3-ASR behind OpenAI's ``POST /v1/audio/transcriptions`` vs transformers'
``Qwen3ASRForConditionalGeneration.generate``): mode ``transcription``, a closed loop of streamed uploads
(``--num-requests`` seeded clips of ``--audio-seconds``, ``--language`` forced) at each ``--concurrency`` (default
1,8) at ``--url``, then the model one request at a time in process (``--baseline transformers``, the default with
``--checkpoint``; ``baseline.py``) on the same clips, with the server's windows (``--window-seconds``,
``--window-search-seconds``) and ``--max-tokens``: requests/s, audio seconds transcribed per second, TTFT (the
first ``transcript.text.delta``), E2E and RTF, failures, engine / baseline ratios, and the transcripts' agreement.

Contract: ``BENCH`` (``omni_serve.bench.plugins``); ``transcription_config(args)`` turns the parsed flags into the
run's ``omni_serve.bench.transcription.TranscriptionBenchConfig`` (``ValueError`` or pydantic's
``ValidationError`` for a usage error); the run is ``omni_serve.bench.transcription.run_transcription_bench``. Run
recipe: ``run.sh`` with ``small.yaml``; the compute ceiling: ``ceiling.py``.
"""

from __future__ import annotations

import logging

from omni_serve.bench import cli as bench_cli
from omni_serve.bench.plugins import BenchPlugin

MODES = {"transcription": "OpenAI audio transcriptions (multipart upload, streamed deltas) over HTTP vs transformers' "
                          "generate in process"}


def add_arguments(group) -> None:
    group.add_argument("--audio-seconds", type=float, default=10.0, metavar="S",
                       help="seconds of audio per upload (seeded tones with quiet gaps; default 10)")
    group.add_argument("--language", default="en",
                       help="language asked for, forced as the model's prefix so the transcript streams from the "
                            "first token; 'none': the model names it (default en)")
    group.add_argument("--prompt", default=None, help="context prompt (the model's system turn; default none)")
    group.add_argument("--max-tokens", type=int, default=512,
                       help="the served graph's max_tokens (tokens per window at most): the baseline's "
                            "max_new_tokens (default 512, the graph's default)")
    group.add_argument("--window-seconds", type=float, default=30.0,
                       help="the served graph's window_seconds, for the baseline's windows (default 30)")
    group.add_argument("--window-search-seconds", type=float, default=5.0,
                       help="the served graph's window_search_seconds (default 5)")
    group.add_argument("--agreement-requests", type=int, default=8, metavar="K",
                       help="after the timed runs, send the first K requests again as verbose_json (not timed) and "
                            "compare their window tokens with the baseline's (0: off; default 8)")


def transcription_config(args):
    from omni_serve.bench.transcription import TranscriptionBenchConfig

    if args.request_rate:
        raise ValueError("transcription mode runs closed loops only: use --concurrency, not --request-rate")
    baseline = args.baseline if args.baseline != "auto" else ("transformers" if args.checkpoint else "none")
    if baseline not in ("transformers", "none"):
        raise ValueError(f"transcription mode baselines are transformers or none, got {baseline!r}")
    language = None if (args.language or "").lower() in ("", "none") else args.language
    return TranscriptionBenchConfig(
        url=args.url, checkpoint=args.checkpoint, model=args.model, num_requests=args.num_requests,
        concurrency=args.concurrency or [1, 8], audio_seconds=args.audio_seconds, language=language,
        prompt=args.prompt, max_tokens=args.max_tokens, window_seconds=args.window_seconds,
        window_search_seconds=args.window_search_seconds, seed=args.seed, warmup=args.warmup,
        agreement_requests=args.agreement_requests if baseline != "none" else 0, baseline=baseline,
        threads=args.threads, calibrate=not args.no_calibration, out=args.out, timeout_s=args.timeout,
        progress_every=args.progress_every, stop_server_pid=args.stop_server_pid)


def run(args) -> int:
    from pydantic import ValidationError

    from omni_serve.bench.transcription import run_transcription_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.url:
        return bench_cli.fail("transcription mode needs --url (the running server)")
    try:
        cfg = transcription_config(args)
    except (ValidationError, ValueError) as exc:
        return bench_cli.fail(bench_cli.validation_message(exc))
    return bench_cli.finish(run_transcription_bench(cfg, _from_config))


def _from_config(cfg):
    from benchmarks.qwen3_asr.baseline import from_config

    return from_config(cfg)


BENCH = BenchPlugin(family="qwen3_asr", modes=MODES, add_arguments=add_arguments, run=run)
