"""``omni-serve`` command line: make checkpoints, serve a graph on a local embedded Ray.

Commands:
  omni-serve make-checkpoint qwen2_5_omni --size tiny|small DIR
  omni-serve serve [--graph qwen2_5_omni] [--config FILE.yaml] [key=value ...]
"""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("omni_serve")

CHECKPOINT_FAMILIES = {"qwen2_5_omni": "omni_serve.checkpoints.qwen2_5_omni"}
GRAPHS = {"qwen2_5_omni": "omni_serve.graphs.qwen2_5_omni:build_app"}


def _import(path: str):
    import importlib

    module, _, attr = path.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def cmd_make_checkpoint(args) -> int:
    mod = _import(CHECKPOINT_FAMILIES[args.family])
    print(f"writing {args.size} {args.family} checkpoint to {args.dir} ...", flush=True)
    mod.make_checkpoint(args.dir, args.size, seed=args.seed)
    print(f"done: {args.dir}", flush=True)
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
    build_app = _import(GRAPHS[args.graph])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, namespace=settings.RAY_NAMESPACE)
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"starting the {args.graph} graph (first start loads every stage; this takes a little while)...",
          flush=True)
    serve.run(build_app(overrides), name=args.graph, route_prefix="/", blocking=False)
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


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="omni-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    mk = sub.add_parser("make-checkpoint", help="write a deterministic random-weight checkpoint")
    mk.add_argument("family", choices=sorted(CHECKPOINT_FAMILIES))
    mk.add_argument("dir")
    mk.add_argument("--size", choices=["tiny", "small"], default="tiny")
    mk.add_argument("--seed", type=int, default=0)
    mk.set_defaults(func=cmd_make_checkpoint)
    sv = sub.add_parser("serve", help="serve a graph on a local embedded Ray")
    sv.add_argument("overrides", nargs="*", help="graph spec overrides, key=value (e.g. checkpoint=DIR)")
    sv.add_argument("--graph", choices=sorted(GRAPHS), default="qwen2_5_omni")
    sv.add_argument("--config", help="YAML file with graph spec values")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    sv.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
