"""The wan bench plug-in (Wan 2.1 text-to-video behind OpenAI's Videos API vs diffusers' ``WanPipeline``): mode
``video``, a closed loop of jobs (create, poll, download the MP4) at each ``--concurrency`` (default 1,4) at
``--url``, then the pipeline one request at a time in process (``--baseline diffusers``, the default with
``--checkpoint``; ``baseline.py``) on the same prompts, seeds (request i: ``--seed`` + i), ``--size``,
``--num-frames``, ``--fps``, ``--steps``, ``--guidance-scale`` and ``--negative-prompt``: videos per hour and seconds
of video per second, E2E latency, failures, engine / baseline ratios.

Contract: ``BENCH`` (``omni_serve.bench.plugins``); ``video_config(args)`` turns the parsed flags into the run's
``omni_serve.bench.video.VideoBenchConfig`` (``ValueError`` or pydantic's ``ValidationError`` for a usage error);
the run is ``omni_serve.bench.video.run_video_bench``. Run recipe: ``run.sh`` with ``small.yaml``; the compute
ceiling: ``ceiling.py``.
"""

from __future__ import annotations

import logging

from omni_serve.bench import cli as bench_cli
from omni_serve.bench.plugins import BenchPlugin

MODES = {"video": "OpenAI Videos API jobs (create, poll, download the MP4) over HTTP vs diffusers in process"}


def add_arguments(group) -> None:
    group.add_argument("--size", default="128x128", metavar="WxH", help="video size (default 128x128)")
    group.add_argument("--num-frames", type=int, default=17, help="frames per video, 4k + 1 (default 17)")
    group.add_argument("--fps", type=int, default=16,
                       help="frames per second: a video lasts num-frames / fps seconds (default 16)")
    group.add_argument("--steps", type=int, default=20, help="num_inference_steps per video (default 20)")
    group.add_argument("--guidance-scale", type=float, default=5.0,
                       help="CFG scale, both systems (none at 1 or below; default 5.0, diffusers' default)")
    group.add_argument("--negative-prompt", default=None,
                       help="negative prompt under CFG (default: none, the empty prompt on both sides)")
    group.add_argument("--poll-interval", type=float, default=0.25, metavar="S",
                       help="seconds between two status polls of one job (default 0.25)")
    group.add_argument("--baseline-dtype", choices=["float32", "bfloat16"], default="float32",
                       help="dtype of the diffusers baseline; set it to the served stages' engine.dtype "
                            "(default float32)")


def video_config(args):
    from omni_serve.bench.video import VideoBenchConfig

    if args.request_rate:
        raise ValueError("video mode runs closed loops only: use --concurrency, not --request-rate")
    baseline = args.baseline if args.baseline != "auto" else ("diffusers" if args.checkpoint else "none")
    if baseline not in ("diffusers", "none"):
        raise ValueError(f"video mode baselines are diffusers or none, got {baseline!r}")
    if args.num_frames % 4 != 1:
        raise ValueError(f"--num-frames must be 4k + 1 (Wan's VAE compresses 4 frames into one), got {args.num_frames}")
    return VideoBenchConfig(
        url=args.url, checkpoint=args.checkpoint, model=args.model, num_requests=args.num_requests,
        concurrency=args.concurrency or [1, 4], size=args.size, num_frames=args.num_frames, fps=args.fps,
        steps=args.steps, guidance_scale=args.guidance_scale, negative_prompt=args.negative_prompt, seed=args.seed,
        warmup=args.warmup, poll_s=args.poll_interval, baseline=baseline, threads=args.threads,
        baseline_dtype=args.baseline_dtype, calibrate=not args.no_calibration, out=args.out,
        timeout_s=args.timeout, progress_every=args.progress_every, stop_server_pid=args.stop_server_pid)


def run(args) -> int:
    from pydantic import ValidationError

    from omni_serve.bench.video import run_video_bench

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.url:
        return bench_cli.fail("video mode needs --url (the running server)")
    try:
        cfg = video_config(args)
    except (ValidationError, ValueError) as exc:
        return bench_cli.fail(bench_cli.validation_message(exc))
    return bench_cli.finish(run_video_bench(cfg, _from_config))


def _from_config(cfg):
    from benchmarks.wan.baseline import from_config

    return from_config(cfg)


BENCH = BenchPlugin(family="wan", modes=MODES, add_arguments=add_arguments, run=run)
