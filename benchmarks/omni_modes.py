"""The modes of the Omni families' benches (qwen2_5_omni, qwen3_omni): their flags and runs.

* ``omni``: streaming chat completions (text + pcm16 audio) at ``--url`` vs ``--baseline hf``: the family's
  transformers ``generate`` one request at a time in this process with the server's inputs and defaults (TTFT =
  TTFP = E2E); ``--baseline cb`` (text only, ``--no-audio``): the thinker through transformers' continuous
  batching. ``--thinker-backend`` names the running server's thinker backend (engine runs are labelled engine /
  engine_vllm); ``python -m omni_serve.bench.report merge OUT A B`` joins two reports.
* ``text`` (Qwen2.5-Omni): thinker only, same token-id prompts: each ``--thinker-backend`` (native: omni_serve's
  engine in process; vllm: vLLM's AsyncLLM with the served thinker's settings, in the vLLM environment's interpreter
  ``--vllm-python``) vs transformers' continuous batching of the thinker (``--baseline cb``, the default here); all
  with the same ``--threads``.
* ``realtime``: spoken turns over ``/v1/realtime`` (``omni_serve.bench.realtime``): C sessions at once, server VAD,
  a barge-in per session, against the same turns as chat requests one at a time (``--baseline none``: no reference).
* ``speech``: ``POST /v1/audio/speech`` (TTFP, RTF, audio seconds per second) vs the family's transformers
  ``generate`` one request at a time (``benchmarks.qwen2_5_omni.speech_baseline``).

For exact comparisons use greedy requests (``--temperature 0``, the default) and give the baseline the server's
talker.max_codec_tokens / code2wav.num_steps (``--max-codec-tokens``, ``--num-steps``); ``--min-tokens`` equal to
``--max-tokens`` fixes output lengths across systems (omni_serve's min_tokens extension).

Contract: ``omni_bench(family, modes, hf, default_for)`` is the family's ``BenchPlugin``; ``hf`` names its
``HFBaseline`` class as ``module:Class``, imported when a run needs it.
"""

from __future__ import annotations

import argparse
import logging

from omni_serve.bench import cli as bench_cli
from omni_serve.bench.plugins import BenchPlugin

MODES = {
    "omni": "streaming chat (text + audio) over HTTP vs the family's transformers generate (default)",
    "text": "thinker only: omni_serve's engine (and vLLM) in process vs transformers' continuous batching",
    "speech": "POST /v1/audio/speech (TTFP, RTF, audio seconds per second) vs transformers, one request at a time",
    "realtime": "spoken turns over /v1/realtime (end of speech to first audio, barge-in, gaps) at each concurrency, "
                "vs the same turns as chat requests one at a time",
}


def _thinker_backends(text: str) -> list[str]:
    backends = bench_cli.str_list(text)
    bad = [b for b in backends if b not in ("native", "vllm")]
    if not backends or bad:
        raise argparse.ArgumentTypeError(f"thinker backends are native and vllm, got {text!r}")
    return backends


def add_arguments(om) -> None:
    om.add_argument("--max-tokens", type=int, default=64, metavar="T", help="max_tokens per request (default 64)")
    om.add_argument("--min-tokens", type=int, default=0, metavar="M",
                    help="omni_serve's min_tokens extension: no stop token before M text tokens; "
                         "M = --max-tokens fixes output lengths (default 0: off)")
    om.add_argument("--no-audio", action="store_true", help="text output only (default: text + pcm16 audio)")
    om.add_argument("--voice", default="Chelsie", help="voice for audio output (default Chelsie)")
    om.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    om.add_argument("--min-words", type=int, default=4, help="shortest prompt in words (default 4)")
    om.add_argument("--max-words", type=int, default=48, help="longest prompt in words (default 48)")
    om.add_argument("--max-codec-tokens", type=int, default=None,
                    help="HF baseline talker max tokens; set it to the server's talker.max_codec_tokens "
                         "(default: the graph spec default)")
    om.add_argument("--num-steps", type=int, default=None,
                    help="HF baseline token2wav ODE steps; set it to the server's code2wav.num_steps "
                         "(default: the graph spec default)")
    om.add_argument("--system-prompt", default=None, help="the server's system_prompt, if it overrides the default")
    om.add_argument("--thinker-backend", type=_thinker_backends, default=None, metavar="native[,vllm]",
                    help="text mode: thinker engines to run, comma-separated: native (omni_serve's engine), vllm "
                         "(vLLM, in --vllm-python); omni mode: the running server's one thinker backend, recorded "
                         "in the report (default native)")
    om.add_argument("--vllm-python", default=None, metavar="PYTHON",
                    help="interpreter of the vLLM environment for text-mode vllm runs (default: "
                         "$OMNI_SERVE_VLLM_PYTHON, else .venv-vllm/bin/python; `make vllm-env` builds it)")
    om.add_argument("--no-retry", action="store_true",
                    help="count a 429 as rejected instead of sending the request again after its "
                         "Retry-After (the default, as a client would)")
    om.add_argument("--turns", type=int, default=2, help="realtime mode: spoken turns per session; the last is "
                    "interrupted (barge-in) when there are two or more (default 2)")
    om.add_argument("--utterance", default=None, metavar="WAV",
                    help="realtime mode: the utterance spoken each turn (default: a speech-like clip)")
    om.add_argument("--cb-page-size", type=int, default=32, help="CB paged-cache page size in tokens (default 32)")
    om.add_argument("--cb-attn-implementation", default="sdpa", choices=["sdpa", "paged|eager"],
                    help="CB attention implementation (both work on CPU; default sdpa)")


def run_speech(args, baseline) -> int:
    from pydantic import ValidationError

    from omni_serve.bench.speech import SpeechBenchConfig, format_report, run_speech_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    chosen = args.baseline if args.baseline != "auto" else ("hf" if args.checkpoint else "none")
    try:
        if chosen == "hf" and not args.checkpoint:
            raise ValueError("the hf baseline needs --checkpoint (the served checkpoint)")
        cfg = SpeechBenchConfig(
            url=args.url, graph=args.graph, checkpoint=args.checkpoint, model=args.model, voice=args.voice,
            num_requests=args.num_requests, concurrency=args.concurrency or [1, 8], seed=args.seed,
            warmup=args.warmup, baseline=chosen, threads=args.threads, stop_server_pid=args.stop_server_pid,
            out=args.out, timeout_s=args.timeout, calibrate=not args.no_calibration,
            client_buffer_s=args.client_buffer, request_rate=args.request_rate, retry_rejected=not args.no_retry,
            **({"min_words": args.min_words} if args.min_words else {}),
            **({"max_words": args.max_words} if args.max_words else {}),
            **({"max_codec_tokens": args.max_codec_tokens} if args.max_codec_tokens else {}),
            **({"num_steps": args.num_steps} if args.num_steps else {}))
    except (ValidationError, ValueError) as exc:
        return bench_cli.fail(bench_cli.validation_message(exc))
    report = run_speech_bench(cfg, baseline)
    print(format_report(report))
    return 1 if any(row["failed"] for row in report["points"]) else 0


def run_realtime(args) -> int:
    from pydantic import ValidationError

    from omni_serve.bench.realtime import RealtimeBenchConfig, format_report, run_realtime_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = RealtimeBenchConfig(url=args.url, model=args.model, concurrency=args.concurrency or [1, 4],
                                  turns=args.turns, utterance=args.utterance, max_output_tokens=args.max_tokens,
                                  reference=args.baseline != "none", client_buffer_s=args.client_buffer,
                                  seed=args.seed, out=args.out, timeout_s=args.timeout, retry=not args.no_retry)
    except ValidationError as exc:
        return bench_cli.fail(bench_cli.validation_message(exc))
    report = run_realtime_bench(cfg)
    print(format_report(report))
    return 1 if any(r["failed"] for r in report["runs"]) else 0


def run_chat(args, systems) -> int:
    from pydantic import ValidationError

    from omni_serve.bench import runner

    if args.baseline == "auto":
        baselines = ["cb"] if args.mode == "text" else (["hf"] if args.checkpoint else [])
    elif args.baseline == "none":
        baselines = []
    else:
        baselines = args.baseline.split(",")
    for noisy in ("ContinuousBatchingLogger", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    backends = args.thinker_backend or ["native"]
    vllm_python = args.vllm_python
    if args.mode == "text" and "vllm" in backends:
        from benchmarks.qwen2_5_omni.vllm_text import resolve_vllm_python

        try:
            vllm_python = resolve_vllm_python(vllm_python)
        except FileNotFoundError as exc:
            return bench_cli.fail(str(exc))
    try:
        cfg = runner.BenchConfig(
            mode=args.mode, graph=args.graph, url=args.url, checkpoint=args.checkpoint, model=args.model,
            num_requests=args.num_requests, concurrency=args.concurrency or [1],
            concurrency_given=args.concurrency is not None, request_rate=args.request_rate,
            max_tokens=args.max_tokens, min_tokens=args.min_tokens, audio=not args.no_audio, voice=args.voice,
            temperature=args.temperature,
            seed=args.seed, min_words=args.min_words, max_words=args.max_words, baselines=baselines, out=args.out,
            warmup=args.warmup, timeout_s=args.timeout, progress_every=args.progress_every,
            max_codec_tokens=args.max_codec_tokens, num_steps=args.num_steps, system_prompt=args.system_prompt,
            threads=args.threads, cb_page_size=args.cb_page_size, cb_attn_implementation=args.cb_attn_implementation,
            stop_server_pid=args.stop_server_pid, thinker_backends=backends, vllm_python=vllm_python,
            calibrate=not args.no_calibration, client_buffer_s=args.client_buffer, retry_rejected=not args.no_retry)
    except ValidationError as exc:
        return bench_cli.fail(bench_cli.validation_message(exc))
    return bench_cli.finish(runner.run_bench(cfg, systems))


def omni_bench(family: str, modes: tuple[str, ...], hf: str, default_for: tuple[str, ...] = ()) -> BenchPlugin:
    """The bench of an Omni family with ``modes`` (of ``MODES``) whose hf baseline is the class at ``hf``."""

    def run(args) -> int:
        from omni_serve.graph.registry import import_path

        if args.mode == "speech":
            from benchmarks.qwen2_5_omni.speech_baseline import run_baseline

            return run_speech(args, run_baseline)
        if args.mode == "realtime":
            return run_realtime(args)
        if family != "qwen2_5_omni" and (args.mode != "omni" or "cb" in args.baseline.split(",")):
            return bench_cli.fail(f"--graph {family} runs in omni mode with the hf baseline (text mode and cb are "
                                  "Qwen2.5-Omni thinker comparisons)")
        from benchmarks.qwen2_5_omni.systems import OmniSystems

        return run_chat(args, OmniSystems(hf=import_path(hf)))

    return BenchPlugin(family=family, modes={m: MODES[m] for m in modes}, add_arguments=add_arguments, run=run,
                       default_for=default_for)
