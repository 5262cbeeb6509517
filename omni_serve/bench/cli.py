"""``omni-serve bench``'s arguments and dispatch: the model-agnostic flags here, each family's own from its bench
plug-in (``omni_serve.bench.plugins``), so a new family's bench needs no edit of this module or of ``omni_serve.cli``.

Contract: ``add_parser(subparsers, argv)`` adds the ``bench`` sub-command to ``omni-serve``'s parser: the generic
flags (endpoint, checkpoint, load shape, output, timing, the transport target's flags) plus, when ``argv`` is a
``bench`` command, one argument group of the plug-in that ``--graph`` / ``--mode`` / ``--checkpoint`` select
(``plugins.resolve``; the default: qwen2_5_omni's omni mode). ``cmd_bench(args)`` runs the transport bench, or the
selected plug-in's ``run(args)`` with ``args.graph`` and ``args.mode`` filled in. Plug-ins share ``finish`` (print
a runner outcome's table and files; 1 when every engine request failed), ``fail`` (a usage error: exit status 2)
and the list parsers below.
"""

from __future__ import annotations

import argparse
import sys

DEFAULT_GRAPH = "qwen2_5_omni"

BENCH_HELP = """\
Replay a deterministic workload against a running omni-serve endpoint and report latency and throughput, next to
in-process baselines of the served family measured in the same run, with engine/baseline ratios. Writes the
report (JSON, PNG) to --out and prints a table. Each model family brings its own bench (benchmarks/<family>/ in
the checkout): its modes, its baselines and its flags, listed by `omni-serve bench --graph FAMILY --help`.

Load: closed loop at each --concurrency value (C requests kept in flight), and open loop with --request-rate
(Poisson arrivals, seeded by --seed; one run per rate, after the closed-loop runs when --concurrency is given, which
then caps requests in flight; alone otherwise). The chat and speech benches send a 429 again after its Retry-After,
as a client would (--no-retry: it counts as rejected).
Baselines read --checkpoint from the local directory only (no network). Without --graph the bench is the family
the checkpoint names (a checkpoint of `omni-serve make-checkpoint`), else the one whose bench has --mode.

benches (--graph: --mode ...):
{benches}

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


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("values must be integers >= 1")
    return values


def float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError("values must be > 0")
    return values


def str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def fail(message: str) -> int:
    print(f"omni-serve bench: {message}", file=sys.stderr)
    return 2


def validation_message(exc: Exception) -> str:
    """The first message of a pydantic ``ValidationError``, else the exception's text."""
    errors = getattr(exc, "errors", None)
    return errors()[0]["msg"] if callable(errors) else str(exc)


def finish(outcome) -> int:
    print()
    print(outcome.table)
    print(f"\nwrote {outcome.json_path}\nwrote {outcome.png_path}", flush=True)
    from omni_serve.bench.report import ENGINE_SYSTEMS

    engine = [r for r in outcome.runs if r.system in ENGINE_SYSTEMS]
    if engine and all(rec.error for r in engine for rec in r.records):
        print("every engine request failed", file=sys.stderr)
        return 1
    return 0


def _selection(argv: list[str]) -> argparse.Namespace:
    """``--graph``, ``--mode`` and ``--checkpoint`` of a ``bench`` command line, before the full parse."""
    pre = argparse.ArgumentParser(add_help=False)
    for flag in ("--graph", "--mode", "--checkpoint"):
        pre.add_argument(flag)
    return pre.parse_known_args(argv)[0]


def add_parser(sub, argv: list[str] | None) -> argparse.ArgumentParser:
    from omni_serve.bench import plugins

    selected = bool(argv) and argv[0] == "bench"  # other commands load no plug-in
    benches = plugins.benches() if selected else {}
    listing = "\n".join(f"  {name}:\n" + "\n".join(f"    {mode}: {text}" for mode, text in p.modes.items())
                        for name, p in benches.items())
    bn = sub.add_parser("bench", help="benchmark a running endpoint against in-process baselines of its family",
                        description=BENCH_HELP.format(benches=listing),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    bn.add_argument("target", nargs="?", choices=["serving", "transport"], default="serving",
                    help="serving: a running endpoint vs in-process baselines (default); transport: data-plane "
                         "backends vs memcpy on this machine (starts its own local Ray)")
    bn.add_argument("--graph", choices=list(benches) if selected else None, default=None,
                    help=f"the served family, whose bench runs (default: the checkpoint's, else {DEFAULT_GRAPH})")
    bn.add_argument("--mode", choices=plugins.modes() if selected else None, default=None,
                    help="what to measure; each family's modes are listed above (default: the family's first)")
    bn.add_argument("--url", help="base URL of the running server, e.g. http://127.0.0.1:8000")
    bn.add_argument("--checkpoint", metavar="DIR", help="local checkpoint directory for the in-process baselines")
    bn.add_argument("--num-requests", type=int, default=16, metavar="N", help="requests per run (default 16)")
    bn.add_argument("--concurrency", type=int_list, default=None, metavar="C[,C...]",
                    help="closed-loop sweep, requests kept in flight (default: the mode's); "
                         "with --request-rate: also the open-loop in-flight cap")
    bn.add_argument("--request-rate", type=float_list, default=None, metavar="R[,R...]",
                    help="open loop: Poisson arrivals per second, one run per rate")
    bn.add_argument("--seed", type=int, default=0, help="workload, per-request and arrival seed (default 0)")
    bn.add_argument("--baseline", default="auto", metavar="NAME[,NAME]",
                    help="in-process baseline(s) of the family, comma-separated, or none (default: the mode's)")
    bn.add_argument("--model", help="model name for requests (default: first id at /v1/models)")
    bn.add_argument("--out", default="bench_out", metavar="DIR", help="where the report files go (default bench_out)")
    bn.add_argument("--warmup", type=int, default=1, help="unmeasured requests per system first (default 1)")
    bn.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds (default 600)")
    bn.add_argument("--no-calibration", action="store_true",
                    help="skip timing the fixed CPU workload before the engine runs and before the baselines (it "
                         "records both and notes drift above 10%%)")
    bn.add_argument("--progress-every", type=int, default=10, metavar="K",
                    help="log progress every K requests (0: off)")
    bn.add_argument("--threads", type=int, default=None, help="torch threads for the in-process baselines "
                    "(default: all cores)")
    bn.add_argument("--client-buffer", type=float, default=0.5, metavar="S",
                    help="seconds a listening client buffers before it plays streamed audio: the report's stalls "
                         "and headroom assume it (default 0.5)")
    bn.add_argument("--stop-server-pid", type=int, default=None, metavar="PID",
                    help="SIGTERM this local server after the engine runs and wait for it to exit, so the "
                         "baselines run on a quiet machine")
    tr = bn.add_argument_group("transport")
    tr.add_argument("--backends", type=str_list, default=None, metavar="B[,B...]",
                    help="connectors to measure (default: auto and every registered one that crosses processes)")
    tr.add_argument("--sizes", type=str_list, default=["4KiB", "1MiB", "64MiB", "512MiB"], metavar="S[,S...]",
                    help="payload sizes (default 4KiB,1MiB,64MiB,512MiB)")
    tr.add_argument("--reps", type=int, default=0,
                    help="measured payloads per size (default 0: 50 up to 1 MiB, 10 at 64 MiB, 4 above)")
    tr.add_argument("--address", default=None, help="Ray cluster to join, host:port (default: a local Ray)")
    tr.add_argument("--producer-node", default=None, metavar="IP", help="run the producer on this node")
    tr.add_argument("--consumer-node", default=None, metavar="IP", help="run the consumer on this node")
    bn.set_defaults(func=cmd_bench, bench_error=None)
    if selected:
        chosen = _selection(argv[1:])
        try:
            plugin = plugins.resolve(chosen.graph, chosen.mode, chosen.checkpoint, DEFAULT_GRAPH)
        except ValueError as exc:  # reported by cmd_bench (or argparse, for a graph or mode it does not know)
            bn.set_defaults(bench_error=str(exc))
        else:
            plugin.add_arguments(bn.add_argument_group(f"{plugin.family} bench"))
    return bn


def cmd_bench_transport(args) -> int:
    from omni_serve.bench.transport import SIZES, TransportBenchConfig, run_transport_bench
    from omni_serve.transport.registry import known_connectors

    bad = [b for b in args.backends or () if b not in known_connectors()] + [s for s in args.sizes if s not in SIZES]
    if bad:
        print(f"omni-serve bench transport: unknown backend or size {', '.join(bad)} (backends: "
              f"{', '.join(known_connectors())}; sizes: {', '.join(SIZES)})", file=sys.stderr)
        return 2
    cfg = TransportBenchConfig(sizes=args.sizes, reps=args.reps, warmup=max(args.warmup, 1), out=args.out,
                               address=args.address, producer_node=args.producer_node,
                               consumer_node=args.consumer_node,
                               **({"backends": args.backends} if args.backends else {}))
    report = run_transport_bench(cfg)
    print(f"report: {report['path']}")
    failed = [b for b, per in report["backends"].items() if any("error" in row for row in per.values())]
    return 1 if failed else 0


def cmd_bench(args) -> int:
    from omni_serve.bench import plugins

    if args.target == "transport":
        return cmd_bench_transport(args)
    if args.bench_error:
        return fail(args.bench_error)
    plugin = plugins.resolve(args.graph, args.mode, args.checkpoint, DEFAULT_GRAPH)
    args.graph, args.mode = plugin.family, args.mode or next(iter(plugin.modes))
    return plugin.run(args)
