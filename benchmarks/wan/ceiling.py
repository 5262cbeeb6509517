"""The Wan text-to-video graph's compute ceiling on this machine (quoted in
docs/benchmarks.md#wan-text-to-video).

Each stage's cost per video, alone, in process, on one torch thread, for the benchmark's requests (its prompts, size,
frames and steps, CFG with the empty negative prompt when --guidance > 1), through the served graph's adapters:

- ``text_encoder``: the prompt and the negative prompt, B videos' prompts encoded together where their token counts
  are equal (as the stage batches them);
- ``dit``: one denoising step of B videos' rows (2 rows each under CFG) through the served ``DenoiseCompute``,
  times the steps;
- ``vae``: one decode of B videos' latents;
- ``mp4``: one video's frames to an H.264 MP4 and its first frame to a PNG (the VAE stage does it in a worker
  thread beside its engine; not batched).

At batch 1 and each power of two up to ``--batch`` (the benchmark's concurrency), the best batch being the cheapest
per video. The ceiling: the cores kept busy with each stage at its best batch, ``cores / sum(best)`` videos/s, and
no faster than one stage allows with the threads the serve config gives it (``threads / best``: the stages run one
replica each; ``--config``, default benchmarks/wan/small.yaml). Both assume perfect scaling over threads, so the
ceiling is an upper bound. ``--bench-report`` reads a ``omni-serve bench --mode video`` report (run.sh runs this
script after its own) and prints each engine run as a fraction of the ceiling and the ceiling's ratio to the run's
diffusers baseline.

    python benchmarks/wan/ceiling.py [checkpoints/wan-small] [--size 128x128] [--frames 17] [--steps 20]
        [--batch 4] [--bench-report bench_out/wan/video_bench_report.json] [--out ceiling.json]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import yaml

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.tools.ceiling_report import against_bench, timed, write_report

from omni_serve.api.video_out import encode_mp4, thumbnail_png
from omni_serve.bench.video import VideoBenchConfig, build_video_workload
from omni_serve.families.wan.spec import WanGraphSpec
from omni_serve.kits.diffusion.messages import PromptEmbeds, VideoDenoiseCall
from omni_serve.kits.diffusion.replica.programs import DenoiseCompute, DenoiseProgram
from omni_serve.models.wan import WanDecoder, WanDenoiser, WanTextEncoder

STAGES = ("text_encoder", "dit", "vae")


def encoder_seconds_per_video(model: WanTextEncoder, texts: list[str], negative: str | None) -> float:
    def run():
        by_len: dict[int, list[str]] = {}
        for t in texts + ([negative] * len(texts) if negative is not None else []):
            by_len.setdefault(model.token_count(t), []).append(t)
        for group in by_len.values():
            model.encode(group)
    return timed(run) / len(texts)


def dit_seconds_per_video(model: WanDenoiser, embeds: list[PromptEmbeds], cfg: VideoBenchConfig) -> float:
    width, height = cfg.dimensions()
    programs = []
    for i, e in enumerate(embeds):
        p = DenoiseProgram(model, VideoDenoiseCall(
            request_id=str(i), n=1, height=height, width=width, num_frames=cfg.num_frames, num_steps=cfg.steps,
            seed=i, true_cfg_scale=cfg.guidance_scale if cfg.guidance_scale > 1 else 1.0))
        p.feed(e)
        programs.append(p)
    compute = DenoiseCompute(model)
    return timed(lambda: compute([p.work()[1] for p in programs])) * cfg.steps / len(embeds)


def vae_seconds_per_video(model: WanDecoder, denoiser: WanDenoiser, cfg: VideoBenchConfig, batch: int) -> float:
    width, height = cfg.dimensions()
    latents = denoiser.initial_latents(batch, cfg.num_frames, height, width, seed=0)
    return timed(lambda: model.decode(latents)) / batch


def mp4_seconds_per_video(model: WanDecoder, denoiser: WanDenoiser, cfg: VideoBenchConfig) -> float:
    width, height = cfg.dimensions()
    frames = model.decode(denoiser.initial_latents(1, cfg.num_frames, height, width, seed=0))[0]
    return timed(lambda: (encode_mp4(frames, cfg.fps), thumbnail_png(frames)))


def stage_threads(config: str) -> dict[str, int]:
    """Each stage's torch threads in the serve config (its defaults where the file names none)."""
    with open(config) as f:
        spec = WanGraphSpec(**{"checkpoint": "unused", **(yaml.safe_load(f) or {})})
    return {stage: spec.stage_spec(stage).engine.torch_threads for stage in STAGES}


def batches(top: int) -> list[int]:
    return sorted({1, top} | {2 ** k for k in range(top.bit_length()) if 2 ** k <= top})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default="checkpoints/wan-small")
    parser.add_argument("--size", default="128x128", help="WIDTHxHEIGHT")
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--fps", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=4, help="the largest batch (the benchmark's concurrency)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--config", default="benchmarks/wan/small.yaml", help="the serve config (stage threads)")
    parser.add_argument("--bench-report", help="an `omni-serve bench --mode video` report to set against the ceiling")
    parser.add_argument("--out", help="write the table as JSON here too")
    args = parser.parse_args()
    cfg = VideoBenchConfig(url="http://unused", num_requests=max(args.batch, 1), size=args.size,
                           num_frames=args.frames, fps=args.fps, steps=args.steps, guidance_scale=args.guidance,
                           baseline="none")
    texts = [r.prompt for r in build_video_workload(cfg)]  # the benchmark's prompts (its workload, seed 0)
    negative = "" if args.guidance > 1 else None  # the server's and the pipeline's negative prompt under CFG
    torch.set_num_threads(1)
    encoder, denoiser, decoder = (WanTextEncoder(args.checkpoint), WanDenoiser(args.checkpoint),
                                  WanDecoder(args.checkpoint))
    costs: dict[str, dict[int, float]] = {stage: {} for stage in STAGES}
    with torch.inference_mode():
        embeds = [PromptEmbeds(prompt_embeds=encoder.encode([t])[0],
                               negative_embeds=encoder.encode([negative])[0] if negative is not None else None)
                  for t in texts]
        for batch in batches(args.batch):
            costs["text_encoder"][batch] = encoder_seconds_per_video(encoder, texts[:batch], negative)
            costs["dit"][batch] = dit_seconds_per_video(denoiser, embeds[:batch], cfg)
            costs["vae"][batch] = vae_seconds_per_video(decoder, denoiser, cfg, batch)
        mp4 = mp4_seconds_per_video(decoder, denoiser, cfg)
    best_batch = {stage: min(by_batch, key=by_batch.get) for stage, by_batch in costs.items()}
    best = {stage: costs[stage][b] for stage, b in best_batch.items()} | {"mp4": mp4}
    total = sum(best.values())
    threads = stage_threads(args.config)
    limits = {"cores": args.cores / total} | {f"{stage} ({threads[stage]} thread{'s' * (threads[stage] > 1)})":
                                              threads[stage] / best[stage] for stage in STAGES}
    ceiling = min(limits.values())
    video_s = args.frames / args.fps
    print(f"per-video seconds on one thread ({args.size}, {args.frames} frames, {args.steps} steps, "
          f"guidance {args.guidance})")
    columns = batches(args.batch)
    print(f"{'stage':<13}" + "".join(f"{f'batch {b}':>10}" for b in columns) + f"{'best':>10}")
    for stage, by_batch in costs.items():
        print(f"{stage:<13}" + "".join(f"{by_batch[b]:>10.3f}" for b in columns) + f"{best[stage]:>10.3f}")
    print(f"{'mp4':<13}" + " " * 10 * len(columns) + f"{mp4:>10.3f}")
    print(f"{'sum':<13}" + "".join(f"{sum(c[b] for c in costs.values()) + mp4:>10.3f}" for b in columns)
          + f"{total:>10.3f}")
    print("ceiling: min(" + ", ".join(f"{k} {v:.3f}" for k, v in limits.items()) + f") = {ceiling:.3f} videos/s = "
          f"{3600 * ceiling:.0f} videos/hour = {ceiling * video_s:.3f} s of video per s")
    report = {"costs_s_per_video": costs, "best_batch": best_batch, "best_s_per_video": best, "limits": limits,
              "ceiling_videos_per_s": ceiling, "ceiling_videos_per_hour": 3600 * ceiling,
              "ceiling_video_s_per_s": ceiling * video_s}
    if args.bench_report:
        report["bench"] = against_bench(args.bench_report, 3600 * ceiling, "videos_per_hour", "diffusers")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
