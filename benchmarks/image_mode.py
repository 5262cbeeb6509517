"""The ``image`` mode of the image families' benches (qwen_image, qwen_image_edit, glm_image): OpenAI image generation
(``POST /v1/images/generations``, b64 PNG) or edits (``--endpoint edits``) at ``--url``, closed loop at each
``--concurrency`` (default 1,8), vs the family's diffusers pipeline in process (``--baseline diffusers``, the default
with ``--checkpoint``) with the same prompts, seeds (request i: ``--seed`` + i), ``--size``, ``--steps``, ``--n``,
``--true-cfg-scale`` and ``--negative-prompt``; per ``--cache-modes`` entry (default dbcache; none skips) one run at
``--cache-concurrency`` with that cache mode, its images/s, cached steps and PSNR vs the uncached image.

Contract: ``image_mode(from_config)`` is the family's ``(add_arguments, run)`` pair for its ``BenchPlugin``:
``from_config(ImageBenchConfig)`` makes its baseline (``benchmarks/<family>/baseline.py``); the run is
``omni_serve.bench.image.run_image_bench``.
"""

from __future__ import annotations

import argparse
import logging

from omni_serve.bench import cli as bench_cli

MODES = {"image": "OpenAI image generation (or --endpoint edits) over HTTP vs diffusers in process"}


def _cache_modes(text: str) -> list[str]:
    modes = [] if text.strip() == "none" else [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("dbcache", "taylorseer")]
    if bad:
        raise argparse.ArgumentTypeError(f"cache modes are dbcache, taylorseer or none, got {','.join(bad)}")
    return modes


def add_arguments(im) -> None:
    im.add_argument("--endpoint", choices=["generations", "edits"], default="generations",
                    help="POST /v1/images/generations (default), or /v1/images/edits: every request edits its "
                         "own input image")
    im.add_argument("--input-size", default="256x256", metavar="WxH",
                    help="edits: size of the generated input images (default 256x256)")
    im.add_argument("--size", default="256x256", metavar="WxH", help="image size (default 256x256)")
    im.add_argument("--steps", type=int, default=20, help="num_inference_steps per image (default 20)")
    im.add_argument("--n", type=int, default=1, help="images per request (default 1)")
    im.add_argument("--true-cfg-scale", type=float, default=None,
                    help="CFG scale sent to both systems (default: theirs; Qwen-Image's CFG needs --negative-prompt)")
    im.add_argument("--negative-prompt", default=None, help="negative prompt; enables true CFG (default: none)")
    im.add_argument("--baseline-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the diffusers baseline pipeline; set it to the served stages' engine.dtype "
                         "(default float32)")
    im.add_argument("--cache-modes", type=_cache_modes, default=["dbcache"], metavar="MODE[,MODE]|none",
                    help="one cached engine run per mode: dbcache, taylorseer; none skips them (default dbcache)")
    im.add_argument("--cache-threshold", type=float, default=0.2,
                    help="cache.residual_diff_threshold of the cached runs (default 0.2)")
    im.add_argument("--cache-concurrency", type=int, default=None,
                    help="concurrency of the cached runs (default: the largest --concurrency)")


def image_config(args):
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


def image_mode(from_config):
    """``(add_arguments, run)`` of an image family's bench whose baseline ``from_config`` makes."""

    def run(args) -> int:
        from pydantic import ValidationError

        from omni_serve.bench import image

        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            cfg = image_config(args)
        except (ValidationError, ValueError) as exc:
            return bench_cli.fail(bench_cli.validation_message(exc))
        return bench_cli.finish(image.run_image_bench(cfg, from_config))

    return add_arguments, run
