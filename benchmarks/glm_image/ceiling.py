"""The GLM-Image graph's compute ceiling on this machine (quoted in docs/benchmarks.md#glm-image).

Each stage's cost per image, alone, in process, on one torch thread (every stage of the served graph runs one),
at batch 1 and at the batch the benchmark reaches (concurrency 8):

- ``ar``: visual tokens of one request on the AR engine (prefill + one decode step per token), B requests at once;
- ``text_encoder``: the glyph embeddings of the prompt and the CFG branch's empty prompt;
- ``dit``: one denoising step over B images' rows (2 rows each under CFG), times the steps;
- ``vae``: one decode of B latents.

With every stage single-threaded, the best the graph can do with two cores is ``cores / sum(per-image cost at
the best batch)`` images/s, and no faster than its slowest stage on one core (one AR replica: ``1 / ar``). The
diffusers pipeline one request at a time on two threads (``--baseline``, the benchmark's baseline) gives the
ratio the same ceiling allows. ``--bench-report`` reads a benchmark report (benchmarks/glm_image/run.sh
runs this script after its own) and prints each engine run's images/s as a fraction of the ceiling, and the
ceiling's ratio to that run's diffusers baseline.

    python benchmarks/glm_image/ceiling.py [checkpoints/glm_image-small] [--size 128] [--steps 20] [--batch 8]
        [--baseline-requests 0] [--bench-report bench_glm_image/image_bench_report.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.tools.ceiling_report import against_bench, ar_seconds_per_request, print_costs, timed, write_report

from omni_serve.engines.ar import ARConfig
from omni_serve.families.glm_image.replica.programs import PriorSequence
from omni_serve.models.glm_image import GlmDenoiseRow, GlmImageAR, GlmImageDecoder, GlmImageDenoiser, \
    GlmImageGlyphEncoder

PROMPTS = [f"a red house by the river, number {i}" for i in range(64)]


def ar_seconds_per_image(checkpoint: str, size: int, batch: int, packed_linear: bool = False) -> float:
    model = GlmImageAR(checkpoint)
    return ar_seconds_per_request(  # warm-up on other prompts (no prefix hits)
        model, ARConfig(packed_linear=packed_linear), lambda i: PriorSequence(model, model.prompt(PROMPTS[i], size, size), model.sampling(i), 16),
        batch, range(32, 32 + batch))


def dit_seconds_per_image(checkpoint: str, size: int, batch: int, steps: int, cfg: bool) -> float:
    model = GlmImageDenoiser(checkpoint)
    glyphs = GlmImageGlyphEncoder(checkpoint).encode([PROMPTS[0]])[0]
    h, w = model.latent_size(size, size)
    prior = torch.zeros(h * w // 4, dtype=torch.long)
    latents = model.initial_latents(batch, size, size, seed=0)
    rows = [GlmDenoiseRow(x, torch.tensor(500.0), glyphs, prior, drop) for x in latents
            for drop in ((False, True) if cfg else (False,))]
    return timed(lambda: model.predict(rows, size, size)) * steps / batch


def encoder_seconds_per_image(checkpoint: str, batch: int, cfg: bool) -> float:
    model = GlmImageGlyphEncoder(checkpoint)
    prompts = [p for p in PROMPTS[:batch] for p in ((p, "") if cfg else (p,))]
    return timed(lambda: model.encode(prompts)) / batch


def vae_seconds_per_image(checkpoint: str, size: int, batch: int) -> float:
    model = GlmImageDecoder(checkpoint)
    latents = GlmImageDenoiser(checkpoint).initial_latents(batch, size, size, seed=0)
    return timed(lambda: model.decode(latents, size, size)) / batch


def baseline_seconds_per_image(checkpoint: str, size: int, steps: int, guidance: float, requests: int) -> float:
    from diffusers import GlmImagePipeline

    torch.set_num_threads(2)
    pipe = GlmImagePipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)

    def run(i: int) -> None:
        pipe(prompt=PROMPTS[i], height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
             generator=torch.Generator().manual_seed(i))
    run(63)
    start = time.perf_counter()
    for i in range(requests):
        run(i)
    return (time.perf_counter() - start) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default="checkpoints/glm_image-small")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=1.5)
    parser.add_argument("--batch", type=int, default=8, help="the best batch (the benchmark's concurrency)")
    parser.add_argument("--packed-linear", action="store_true",
                        help="the AR's linear layers prepacked (stages.ar.engine.ar.packed_linear; off by default)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--baseline-requests", type=int, default=4,
                        help="diffusers requests to time for the ratio (0: skip)")
    parser.add_argument("--bench-report", help="an `omni-serve bench --mode image` report to set against the ceiling")
    parser.add_argument("--out", help="write the table as JSON here too")
    args = parser.parse_args()
    cfg = args.guidance > 1
    torch.set_num_threads(1)
    costs: dict[str, dict[int, float]] = {}
    for batch in sorted({1, args.batch}):
        torch.set_num_threads(1)
        costs.setdefault("ar", {})[batch] = ar_seconds_per_image(args.checkpoint, args.size, batch,
                                                             args.packed_linear)
        costs.setdefault("text_encoder", {})[batch] = encoder_seconds_per_image(args.checkpoint, batch, cfg)
        costs.setdefault("dit", {})[batch] = dit_seconds_per_image(args.checkpoint, args.size, batch, args.steps,
                                                                   cfg)
        costs.setdefault("vae", {})[batch] = vae_seconds_per_image(args.checkpoint, args.size, batch)
    best = {stage: min(by_batch.values()) for stage, by_batch in costs.items()}
    total = sum(best.values())
    ceiling = min(args.cores / total, 1 / max(best.values()))
    print(f"per-image seconds on one thread ({args.size}x{args.size}, {args.steps} steps, CFG {args.guidance})")
    print_costs(costs, args.batch, total)
    print(f"ceiling: min({args.cores} cores / {total:.3f} s, 1 / {max(best.values()):.3f} s (slowest stage, one "
          f"replica)) = {ceiling:.3f} images/s")
    report = {"costs_s_per_image": costs, "best_s_per_image": best, "ceiling_images_per_s": ceiling}
    if args.baseline_requests:
        torch.set_num_threads(2)
        base = baseline_seconds_per_image(args.checkpoint, args.size, args.steps, args.guidance,
                                          args.baseline_requests)
        report["diffusers_images_per_s"] = 1 / base
        report["ceiling_ratio"] = ceiling * base
        print(f"diffusers one at a time, 2 threads: {1 / base:.3f} images/s -> ceiling ratio {ceiling * base:.2f}x")
    if args.bench_report:
        report["bench"] = against_bench(args.bench_report, ceiling, "images_per_s", "diffusers")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
