"""``omni-serve`` command line: make checkpoints, serve a graph on a local embedded Ray.

Commands (GRAPH: a model family of the registry, ``omni-serve graph`` lists them):
  omni-serve make-checkpoint GRAPH --size tiny|small DIR
  omni-serve serve [--graph GRAPH] [--config FILE.yaml] [--api-key KEY] [key=value ...]
  omni-serve build GRAPH [key=value ...] [--config FILE.yaml] [-o serve_config.yaml]
  omni-serve graph [GRAPH] [--layout L] [--markdown]   (the families, or one graph's stages and edges)
  omni-serve bench --url URL --checkpoint DIR [--concurrency 1,16] [--mode omni|text|image] ... (see bench --help)
  omni-serve bench transport [--backends auto,B,...] [--sizes 4KiB,1MiB,64MiB,512MiB]
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("omni_serve")

DEFAULT_GRAPH = "qwen2_5_omni"


def _families():
    from omni_serve.graph.registry import families

    return families()


def _checkpoint_writers() -> dict[str, str]:
    from omni_serve.checkpoints import UNSERVED_WRITERS

    served = {name: f.checkpoint_writer for name, f in _families().items() if f.checkpoint_writer}
    return {**UNSERVED_WRITERS, **served}


def cmd_make_checkpoint(args) -> int:
    from omni_serve.graph.registry import import_path

    print(f"writing {args.size} {args.family} checkpoint to {args.dir} ...", flush=True)
    import_path(_checkpoint_writers()[args.family])(args.dir, args.size, seed=args.seed)
    print(f"done: {args.dir}", flush=True)
    return 0


def cmd_graph(args) -> int:
    if args.markdown:
        from omni_serve.graph.docs import markdown

        sys.stdout.write(markdown(_families() if args.graph is None else {args.graph: _families()[args.graph]}))
        return 0
    if args.graph is None:
        for name, family in _families().items():
            print(f"{name:16s} {family.description}")
        return 0
    family = _families()[args.graph]
    if args.layout is not None and args.layout not in family.graph.layouts:
        print(f"omni-serve graph: {family.name} has no layout {args.layout!r}; its layouts: "
              f"{', '.join(family.graph.layouts)}", file=sys.stderr)
        return 2
    print(f"{family.name}: {family.description}")
    print(f"  serve: omni-serve serve --graph {family.name} checkpoint=DIR   (or serve run {family.app} ...)")
    print(family.graph.describe(args.layout))
    return 0


def _parse_overrides(pairs: list[str]) -> dict:
    import yaml

    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise SystemExit(f"override {pair!r} is not key=value")
        key, value = pair.split("=", 1)
        out[key] = yaml.safe_load(value)
    return out


def cmd_serve(args) -> int:
    import os
    import signal
    import time

    import ray
    from ray import serve

    from omni_serve import settings

    overrides = _parse_overrides(args.overrides)
    if args.config:
        import yaml

        with open(args.config) as f:
            overrides = {**yaml.safe_load(f), **overrides}
    family = _families()[args.graph]
    if args.api_key:
        # The ingress replicas read it from their environment (inherited from this process, which starts the
        # local Ray), so the key is in no deployment's arguments.
        os.environ[settings.API_KEY_ENV] = args.api_key
    elif not os.environ.get(settings.API_KEY_ENV) and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without an API key: anyone who can reach the port can use the "
              f"API (--api-key, {settings.API_KEY_ENV} or ingress.api_key_file set one).", file=sys.stderr)
    # Ray's own default applies: token authentication for a new local cluster (the token is written to
    # ~/.ray/auth_token); RAY_AUTH_MODE=disabled opts out.
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, namespace=settings.RAY_NAMESPACE)
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"starting the {args.graph} graph (first start loads every stage; this takes a little while)...",
          flush=True)
    from omni_serve.deployments.builder import build_app

    serve.run(build_app(family, overrides), name=args.graph, route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    print(f"\nomni_serve is up: {url}  (OpenAI API under {url}/v1, health at {url}/health)", flush=True)
    print("Press Ctrl-C to stop.", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    print("shutting down ...", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0


def cmd_build(args) -> int:
    from omni_serve.graph.serve_config import build_serve_config, render

    values = _parse_overrides(args.overrides)
    if args.config:
        import yaml

        with open(args.config) as f:
            values = {**(yaml.safe_load(f) or {}), **values}
    try:
        config, notes = build_serve_config(args.graph, values, app_name=args.name,
                                           route_prefix=args.route_prefix, host=args.host, port=args.port)
    except ValueError as exc:
        print(f"omni-serve build: invalid {args.graph} graph values:\n{exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    text = render(config, args.graph, "-" if args.output == "-" else args.output)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output}: serve deploy {args.output}  (or: serve run {args.output})", file=sys.stderr)
    return 0


BENCH_HELP = """\
Replay a deterministic workload of N chat requests against a running omni-serve endpoint (streaming
chat completions) and report latency and throughput, next to an in-process transformers baseline
measured in the same run, with engine/baseline ratios.

Per run: P50/P95/P99/mean of TTFT (first text delta), TTFP (first audio delta), ITL (gaps between text
deltas), E2E and RTF (E2E / audio seconds); requests/s, output tokens/s and audio seconds per second
over the run's wall time; failed requests (counted, never dropped). Writes bench_report.json and
bench_report.png to --out and prints a table.

Modes:
  omni  HTTP engine at --url vs --baseline hf: Qwen2_5OmniForConditionalGeneration.generate run one
        request at a time in this process with the server's inputs and defaults (TTFT = TTFP = E2E).
  text  thinker only, same token-id prompts: each --thinker-backend (native: omni_serve's engine in process,
        run_engine_text; vllm: vLLM's AsyncLLM with the served thinker's settings, run in the vLLM
        environment's interpreter --vllm-python) vs transformers' continuous batching of the thinker as a
        Qwen2ForCausalLM (--baseline cb, the default here); all with the same --threads.
        In omni mode --thinker-backend names the running server's thinker backend (engine runs are
        labelled engine / engine_vllm); `python -m omni_serve.bench.report merge OUT A B` joins two reports.
  image OpenAI image generation (POST /v1/images/generations, b64 PNG) at --url, e.g. the qwen_image
        graph, closed loop at each --concurrency (default 1,8), vs --baseline diffusers (default with
        --checkpoint): QwenImagePipeline run one request at a time in this process with the same prompts,
        seeds (request i: --seed + i), --size, --steps, --n, --true-cfg-scale and --negative-prompt.
        --endpoint edits: image edits instead (POST /v1/images/edits, e.g. the qwen_image_edit graph), each
        request with its own --input-size input image, vs diffusers' QwenImageEditPipeline.
        Reports images/s and requests/s, E2E P50/P95/P99/mean, engine/baseline ratios, pixel parity
        (max abs uint8 difference per request vs diffusers) and, per --cache-modes entry (default
        dbcache; none skips), one run at --cache-concurrency with that cache mode and --cache-threshold:
        images/s, cached steps per image and PSNR vs the uncached image of the same request. Writes
        image_bench_report.json and image_bench_report.png to --out.

Load: closed loop at each --concurrency value (C requests kept in flight), or open loop with
--request-rate (Poisson arrivals, seeded by --seed; one run per rate; an explicit --concurrency then
caps requests in flight). Baselines read --checkpoint from the local directory only (no network).
For exact comparisons use greedy requests (--temperature 0, the default) and give the baseline the
server's talker.max_codec_tokens / code2wav.num_steps (--max-codec-tokens, --num-steps). To fix output
lengths across systems, set --min-tokens equal to --max-tokens (omni_serve's min_tokens extension).

examples:
  omni-serve bench --url http://127.0.0.1:8000 --checkpoint checkpoints/qwen2_5_omni-tiny \\
      --num-requests 32 --concurrency 1,4,16 --max-tokens 32 --baseline hf --out bench_out
  omni-serve bench --graph qwen3_omni --url http://127.0.0.1:8000 --checkpoint checkpoints/qwen3_omni-small \\
      --concurrency 1,16 --baseline hf --out bench_qwen3
  omni-serve bench --url http://127.0.0.1:8000 --num-requests 100 --request-rate 2 --no-audio --baseline none
  omni-serve bench --mode text --checkpoint checkpoints/qwen2_5_omni-tiny --concurrency 1,8 --max-tokens 64
  omni-serve bench --mode text --checkpoint checkpoints/qwen2_5_omni-tiny --concurrency 1,8 \\
      --thinker-backend native,vllm --vllm-python .venv-vllm/bin/python
  omni-serve bench --mode image --url http://127.0.0.1:8000 --checkpoint checkpoints/qwen_image-tiny \\
      --num-requests 16 --concurrency 1,8 --size 256x256 --steps 20 --cache-modes dbcache,taylorseer
"""


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be integers >= 1")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("values must be > 0")
    return values


def _str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _thinker_backends(text: str) -> list[str]:
    backends = _str_list(text)
    bad = [b for b in backends if b not in ("native", "vllm")]
    if not backends or bad:
        raise argparse.ArgumentTypeError(f"thinker backends are native and vllm, got {text!r}")
    return backends


def _cache_modes(text: str) -> list[str]:
    modes = [] if text.strip() == "none" else [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("dbcache", "taylorseer")]
    if bad:
        raise argparse.ArgumentTypeError(f"cache modes are dbcache, taylorseer or none, got {','.join(bad)}")
    return modes


def _speech_bench(args) -> int:
    from pydantic import ValidationError

    from omni_serve.bench.speech import SpeechBenchConfig, format_report, run_speech_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    baseline = args.baseline if args.baseline != "auto" else ("hf" if args.checkpoint else "none")
    try:
        if baseline == "hf" and not args.checkpoint:
            raise ValueError("the hf baseline needs --checkpoint (the served checkpoint)")
        cfg = SpeechBenchConfig(
            url=args.url, graph=args.graph, checkpoint=args.checkpoint, model=args.model, voice=args.voice,
            num_requests=args.num_requests, concurrency=args.concurrency or [1, 8], seed=args.seed,
            warmup=args.warmup, baseline=baseline, threads=args.threads, stop_server_pid=args.stop_server_pid,
            out=args.out, timeout_s=args.timeout, calibrate=not args.no_calibration,
            **({"min_words": args.min_words} if args.min_words else {}),
            **({"max_words": args.max_words} if args.max_words else {}),
            **({"max_codec_tokens": args.max_codec_tokens} if args.max_codec_tokens else {}),
            **({"num_steps": args.num_steps} if args.num_steps else {}))
    except (ValidationError, ValueError) as exc:
        msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
        print(f"omni-serve bench: {msg}", file=sys.stderr)
        return 2
    report = run_speech_bench(cfg)
    print(format_report(report))
    return 1 if any(row["failed"] for row in report["points"]) else 0


def _image_bench_config(args):
    from omni_serve.bench.image import ImageBenchConfig

    if args.request_rate:
        raise ValueError("image mode runs closed loops only: use --concurrency, not --request-rate")
    baseline = args.baseline if args.baseline != "auto" else ("diffusers" if args.checkpoint else "none")
    if baseline not in ("diffusers", "none"):
        raise ValueError(f"image mode baselines are diffusers or none, got {baseline!r}")
    return ImageBenchConfig(
        url=args.url, checkpoint=args.checkpoint, model=args.model, num_requests=args.num_requests,
        endpoint=args.endpoint, input_size=args.input_size,
        concurrency=args.concurrency or [1, 8], size=args.size, steps=args.steps, n=args.n,
        true_cfg_scale=args.true_cfg_scale, negative_prompt=args.negative_prompt, seed=args.seed, warmup=args.warmup,
        baseline=baseline, threads=args.threads, baseline_dtype=args.baseline_dtype, cache_modes=args.cache_modes,
        cache_threshold=args.cache_threshold, cache_concurrency=args.cache_concurrency,
        stop_server_pid=args.stop_server_pid, out=args.out,
        timeout_s=args.timeout, progress_every=args.progress_every)


def cmd_bench_transport(args) -> int:
    from omni_serve.bench.transport import SIZES, TransportBenchConfig, run_transport_bench
    from omni_serve.transport.registry import known_connectors

    bad = [b for b in args.backends or () if b not in known_connectors()] + [s for s in args.sizes if s not in SIZES]
    if bad:
        print(f"omni-serve bench transport: unknown backend or size {', '.join(bad)} (backends: "
              f"{', '.join(known_connectors())}; sizes: {', '.join(SIZES)})", file=sys.stderr)
        return 2
    cfg = TransportBenchConfig(sizes=args.sizes, reps=args.reps, warmup=max(args.warmup, 1), out=args.out,
                               **({"backends": args.backends} if args.backends else {}))
    report = run_transport_bench(cfg)
    print(f"report: {report['path']}")
    failed = [b for b, per in report["backends"].items() if any("error" in row for row in per.values())]
    return 1 if failed else 0


def cmd_bench(args) -> int:
    from pydantic import ValidationError

    from omni_serve.bench.runner import BenchConfig, run_bench

    if args.target == "transport":
        return cmd_bench_transport(args)

    if args.mode == "speech":
        return _speech_bench(args)
    if args.mode == "image":
        from omni_serve.bench.image import run_image_bench

        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            cfg = _image_bench_config(args)
        except (ValidationError, ValueError) as exc:
            msg = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else str(exc)
            print(f"omni-serve bench: {msg}", file=sys.stderr)
            return 2
        return _finish_bench(run_image_bench(cfg))
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
        from omni_serve.bench.vllm_text import resolve_vllm_python

        try:
            vllm_python = resolve_vllm_python(vllm_python)
        except FileNotFoundError as exc:
            print(f"omni-serve bench: {exc}", file=sys.stderr)
            return 2
    try:
        cfg = BenchConfig(
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
            calibrate=not args.no_calibration)
    except ValidationError as exc:
        print(f"omni-serve bench: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    return _finish_bench(run_bench(cfg))


def _finish_bench(outcome) -> int:
    print()
    print(outcome.table)
    print(f"\nwrote {outcome.json_path}\nwrote {outcome.png_path}", flush=True)
    from omni_serve.bench.report import ENGINE_SYSTEMS

    engine = [r for r in outcome.runs if r.system in ENGINE_SYSTEMS]
    if engine and all(rec.error for r in engine for rec in r.records):
        print("every engine request failed", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="omni-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-checkpoint", help="write a deterministic random-weight checkpoint")
    mk.add_argument("family", choices=sorted(_checkpoint_writers()))
    mk.add_argument("dir")
    mk.add_argument("--size", choices=["tiny", "small"], default="tiny")
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=cmd_make_checkpoint)
    sv = sub.add_parser("serve", help="serve a graph on a local embedded Ray")
    sv.add_argument("overrides", nargs="*", help="graph spec overrides, key=value (e.g. checkpoint=DIR)")
    sv.add_argument("--graph", choices=list(_families()), default=DEFAULT_GRAPH)
    sv.add_argument("--config", help="YAML file with graph spec values")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* and /metrics "
                    "(also: the OMNI_SERVE_API_KEY environment variable, or ingress.api_key_file=FILE)")
    sv.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    sv.set_defaults(func=cmd_serve)
    bd = sub.add_parser("build", help="write a complete Ray Serve config (serve run / serve deploy) for a graph")
    bd.add_argument("graph", choices=list(_families()))
    bd.add_argument("overrides", nargs="*", help="graph spec values, key=value (e.g. checkpoint=DIR "
                    "stages.talker.autoscaling_config.max_replicas=4)")
    bd.add_argument("--config", help="YAML file with graph spec values (key=value overrides win)")
    bd.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    bd.add_argument("--name", default=None, help="application name (default: the graph's)")
    bd.add_argument("--route-prefix", default="/", help="HTTP route prefix (default /)")
    bd.add_argument("--host", default="0.0.0.0", help="Serve HTTP host (default 0.0.0.0)")
    bd.add_argument("--port", type=int, default=8000, help="Serve HTTP port (default 8000)")
    bd.set_defaults(func=cmd_build)
    gr = sub.add_parser("graph", help="list the model families, or show one graph's stages and edges")
    gr.add_argument("graph", nargs="?", choices=list(_families()), help="a family (default: list them all)")
    gr.add_argument("--layout", default=None, help="one layout of the graph (default: all)")
    gr.add_argument("--markdown", action="store_true", help="the reference page of docs/graphs.md")
    gr.set_defaults(func=cmd_graph)
    bn = sub.add_parser("bench", help="benchmark a running endpoint against an in-process transformers baseline",
                        description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    bn.add_argument("target", nargs="?", choices=["serving", "transport"], default="serving",
                    help="serving: a running endpoint vs in-process baselines (default); transport: data-plane "
                         "backends vs memcpy on this machine (starts its own local Ray)")
    bn.add_argument("--url", help="base URL of the running server, e.g. http://127.0.0.1:8000 (omni, image modes)")
    bn.add_argument("--checkpoint", metavar="DIR",
                    help="local checkpoint directory for the baselines (text mode: required)")
    bn.add_argument("--mode", choices=["omni", "text", "image", "speech"], default="omni",
                    help="omni: HTTP engine vs HF generate (default); text: thinker-only engine vs transformers CB; "
                         "image: HTTP image generation vs diffusers; speech: POST /v1/audio/speech (TTFP, RTF, audio "
                         "seconds per second) vs transformers one request at a time")
    bn.add_argument("--graph", choices=["qwen2_5_omni", "qwen3_omni"], default="qwen2_5_omni",
                    help="omni mode: the served Omni family, whose transformers generate is the hf baseline "
                         "(default qwen2_5_omni)")
    bn.add_argument("--num-requests", type=int, default=16, metavar="N", help="requests per run (default 16)")
    bn.add_argument("--concurrency", type=_int_list, default=None, metavar="C[,C...]",
                    help="closed-loop sweep, requests kept in flight (default 1; image mode 1,8); "
                         "with --request-rate: in-flight cap")
    bn.add_argument("--request-rate", type=_float_list, default=None, metavar="R[,R...]",
                    help="open loop: Poisson arrivals per second, one run per rate")
    bn.add_argument("--max-tokens", type=int, default=64, metavar="T", help="max_tokens per request (default 64)")
    bn.add_argument("--min-tokens", type=int, default=0, metavar="M",
                    help="omni_serve's min_tokens extension: no stop token before M text tokens; "
                         "M = --max-tokens fixes output lengths (default 0: off)")
    bn.add_argument("--no-audio", action="store_true", help="text output only (default: text + pcm16 audio)")
    bn.add_argument("--voice", default="Chelsie", help="voice for audio output (default Chelsie)")
    bn.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default)")
    bn.add_argument("--seed", type=int, default=0, help="workload, per-request and arrival seed (default 0)")
    bn.add_argument("--min-words", type=int, default=4, help="shortest prompt in words (default 4)")
    bn.add_argument("--max-words", type=int, default=48, help="longest prompt in words (default 48)")
    bn.add_argument("--baseline", default="auto", metavar="{hf,cb,diffusers,none}",
                    help="in-process baseline(s), comma-separated: hf (Omni generate), cb (transformers continuous "
                         "batching, text only), diffusers (image mode), none. Default: hf with --checkpoint in omni "
                         "mode, cb in text mode, diffusers with --checkpoint in image mode")
    bn.add_argument("--model", help="model name for requests (default: first id at /v1/models)")
    bn.add_argument("--out", default="bench_out", metavar="DIR",
                    help="where bench_report.json/.png go (default bench_out)")
    bn.add_argument("--warmup", type=int, default=1, help="unmeasured requests per system first (default 1)")
    bn.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    bn.add_argument("--no-calibration", action="store_true",
                    help="omni/text/speech modes: skip timing the fixed CPU workload before the engine runs and "
                         "before the baselines (it records both and notes drift above 10%%)")
    bn.add_argument("--progress-every", type=int, default=10, metavar="K",
                    help="log progress every K requests (0: off)")
    bn.add_argument("--max-codec-tokens", type=int, default=None,
                    help="HF baseline talker max tokens; set it to the server's talker.max_codec_tokens "
                         "(default: the graph spec default)")
    bn.add_argument("--num-steps", type=int, default=None,
                    help="HF baseline token2wav ODE steps; set it to the server's code2wav.num_steps "
                         "(default: the graph spec default)")
    bn.add_argument("--system-prompt", default=None, help="the server's system_prompt, if it overrides the default")
    bn.add_argument("--threads", type=int, default=None,
                    help="torch threads for baselines; text mode: for every system, vLLM included (default: all "
                         "cores)")
    bn.add_argument("--baseline-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="image mode: dtype of the diffusers baseline pipeline; set it to the served stages' "
                         "engine.dtype (default float32)")
    bn.add_argument("--thinker-backend", type=_thinker_backends, default=None, metavar="native[,vllm]",
                    help="text mode: thinker engines to run, comma-separated: native (omni_serve's engine), vllm "
                         "(vLLM, in --vllm-python); omni mode: the running server's one thinker backend, recorded "
                         "in the report (default native)")
    bn.add_argument("--vllm-python", default=None, metavar="PYTHON",
                    help="interpreter of the vLLM environment for text-mode vllm runs (default: "
                         "$OMNI_SERVE_VLLM_PYTHON, else .venv-vllm/bin/python; `make vllm-env` builds it)")
    bn.add_argument("--stop-server-pid", type=int, default=None, metavar="PID",
                    help="SIGTERM this local server after the engine runs and wait for it to exit, so the "
                         "baselines run on a quiet machine (omni and image modes)")
    bn.add_argument("--cb-page-size", type=int, default=32, help="CB paged-cache page size in tokens (default 32)")
    bn.add_argument("--cb-attn-implementation", default="sdpa", choices=["sdpa", "paged|eager"],
                    help="CB attention implementation (both work on CPU; default sdpa)")
    im = bn.add_argument_group("image mode")
    im.add_argument("--endpoint", choices=["generations", "edits"], default="generations",
                    help="POST /v1/images/generations (default), or /v1/images/edits: every request edits its "
                         "own input image, the baseline is diffusers' QwenImageEditPipeline")
    im.add_argument("--input-size", default="256x256", metavar="WxH",
                    help="edits: size of the generated input images (default 256x256)")
    im.add_argument("--size", default="256x256", metavar="WxH", help="image size (default 256x256)")
    im.add_argument("--steps", type=int, default=20, help="num_inference_steps per image (default 20)")
    im.add_argument("--n", type=int, default=1, help="images per request (default 1)")
    im.add_argument("--true-cfg-scale", type=float, default=None,
                    help="CFG scale sent to both systems (default: theirs, 4.0; CFG needs --negative-prompt)")
    im.add_argument("--negative-prompt", default=None, help="negative prompt; enables true CFG (default: none)")
    im.add_argument("--cache-modes", type=_cache_modes, default=["dbcache"], metavar="MODE[,MODE]|none",
                    help="one cached engine run per mode: dbcache, taylorseer; none skips them (default dbcache)")
    im.add_argument("--cache-threshold", type=float, default=0.2,
                    help="cache.residual_diff_threshold of the cached runs (default 0.2)")
    im.add_argument("--cache-concurrency", type=int, default=None,
                    help="concurrency of the cached runs (default: the largest --concurrency)")
    tr = bn.add_argument_group("transport")
    tr.add_argument("--backends", type=_str_list, default=None, metavar="B[,B...]",
                    help="connectors to measure (default: auto and every registered one that crosses processes)")
    tr.add_argument("--sizes", type=_str_list, default=["4KiB", "1MiB", "64MiB", "512MiB"], metavar="S[,S...]",
                    help="payload sizes (default 4KiB,1MiB,64MiB,512MiB)")
    tr.add_argument("--reps", type=int, default=0,
                    help="measured payloads per size (default 0: 50 up to 1 MiB, 10 at 64 MiB, 4 above)")
    bn.set_defaults(func=cmd_bench)
    # key=value overrides may come before or after options (argparse stops a positional list at the first
    # option); anything else unknown is an error.
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
