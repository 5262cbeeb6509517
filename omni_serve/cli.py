"""``omni-serve`` command line: make checkpoints, serve a graph on a local embedded Ray.

Commands (GRAPH: a model family of the registry, ``omni-serve graph`` lists them):
  omni-serve make-checkpoint GRAPH --size tiny|small DIR
  omni-serve serve [--graph GRAPH] [--config FILE.yaml] [--api-key-file FILE] [key=value ...]
  omni-serve build GRAPH [key=value ...] [--config FILE.yaml] [-o serve_config.yaml]
  omni-serve graph [GRAPH] [--layout L] [--markdown | --config-markdown]   (the families, or one graph's stages
    and edges; the reference pages docs/graphs.md and docs/configuration.md)
  omni-serve bench [--graph GRAPH] [--mode MODE] --url URL --checkpoint DIR ... (see bench [--graph GRAPH] --help)
  omni-serve bench transport [--backends auto,B,...] [--sizes 4KiB,1MiB,64MiB,512MiB]
  omni-serve drain-node [--deadline-s S]   (on a cluster node about to stop: Serve moves its replicas away and
    the requests they hold finish; the chart's preStop hook runs it before `ray stop`)
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
    if args.config_markdown:
        from omni_serve.graph.config_docs import markdown as config_markdown

        sys.stdout.write(config_markdown(_families() if args.graph is None else {args.graph: _families()[args.graph]}))
        return 0
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
    if args.api_key is not None:
        # A key on the command line is visible to every local user (ps, /proc/<pid>/cmdline): refused.
        sys.exit(f"error: --api-key would show the key in the process list; put it in a file "
                 f"(--api-key-file FILE, one key per line) or in the {settings.API_KEY_ENV} environment variable")
    if args.api_key_file:
        from omni_serve.api.guards import read_key_file

        path = os.path.abspath(args.api_key_file)
        try:
            if not read_key_file(path):
                sys.exit(f"error: --api-key-file {path} holds no key")
        except OSError as exc:
            sys.exit(f"error: --api-key-file: {exc}")
        # The ingress replicas read the file when they start (same machine: the local Ray).
        overrides["ingress.api_key_file"] = path
    elif not os.environ.get(settings.API_KEY_ENV) and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without an API key: anyone who can reach the port can use the "
              f"API (--api-key-file, {settings.API_KEY_ENV} or ingress.api_key_file set one).", file=sys.stderr)
    # Ray's own default applies: token authentication for a new local cluster (the token is written to
    # ~/.ray/auth_token); RAY_AUTH_MODE=disabled opts out.
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, namespace=settings.RAY_NAMESPACE)

    # ray.init sets a SIGTERM handler that exits at once (status 15) without stopping Serve. Ours turns SIGTERM,
    # whenever it comes (while the graph starts or once it serves), into the same orderly stop as Ctrl-C.
    def stop_on_sigterm(*_):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the shutdown short
        raise _Stop

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        print(f"starting the {args.graph} graph (first start loads every stage; this takes a little while)...",
              flush=True)
        from omni_serve.deployments.builder import build_app

        serve.run(build_app(family, overrides), name=args.graph, route_prefix="/", blocking=False)
        url = f"http://{args.host}:{args.port}"
        print(f"\nomni_serve is up: {url}  (OpenAI API under {url}/v1, health at {url}/health)", flush=True)
        print("Press Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (_Stop)
        pass
    # A supervisor's second SIGTERM would cut the shutdown short and leave Ray's processes behind (a second
    # Ctrl-C still does, on purpose).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("shutting down ...", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0


class _Stop(KeyboardInterrupt):
    """Raised by ``serve``'s SIGTERM handler: stop as Ctrl-C does. A KeyboardInterrupt: no ``except Exception``
    on the way swallows it, and Ray's blocking calls pass it on (they print and drop other exceptions raised by
    a signal handler)."""


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


def cmd_drain_node(args) -> int:
    from omni_serve.deployments.drain_node import drain_node

    return drain_node(args.deadline_s, args.poll_s, address=args.address)


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
    sv.add_argument("--api-key-file", default=None, metavar="FILE", help="require 'Authorization: Bearer KEY' "
                    "on /v1/* and /metrics for a KEY of FILE (one per line; also: the OMNI_SERVE_API_KEY "
                    "environment variable)")
    sv.add_argument("--api-key", default=None, help=argparse.SUPPRESS)  # refused: argv is public
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
    gr.add_argument("--config-markdown", action="store_true", help="the config reference, docs/configuration.md")
    gr.set_defaults(func=cmd_graph)
    dn = sub.add_parser("drain-node", help="drain this Ray node: Serve moves its replicas elsewhere, their "
                        "requests finish; returns once none is left (run before `ray stop`)")
    dn.add_argument("--deadline-s", type=float, default=600.0,
                    help="the drain's deadline: Serve stops a replica at the deadline minus its graceful shutdown "
                    "time (the request deadline, 300 s by default) whether or not its replacement runs, so leave "
                    "room for a replacement to start (default 600 s)")
    dn.add_argument("--address", default=None, help="the cluster's GCS address (default: RAY_ADDRESS, else "
                    "the cluster this node belongs to)")
    dn.add_argument("--poll-s", type=float, default=2.0, help=argparse.SUPPRESS)
    dn.set_defaults(func=cmd_drain_node)
    from omni_serve.bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub, sys.argv[1:] if argv is None else argv)  # its flags: omni_serve.bench.cli
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
