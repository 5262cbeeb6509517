"""The Qwen-Image graph's compute ceiling on this machine (quoted in docs/qwen_image.md#benchmark).

Each stage's cost per image, alone, in process, on one torch thread (every stage of the benchmark's graph runs one),
in the benchmark's dtype, for the benchmark's requests (its prompts, true CFG with the " " negative prompt):

- ``text_encoder``: the prompt and the negative prompt, B images' prompts encoded together where their token
  counts are equal (as the stage batches them);
- ``dit``: one denoising step of B requests' rows (2 rows each under CFG) through the served ``DenoiseCompute``
  (packed text rows, prepacked linear layers), times the steps;
- ``vae``: one decode of B latents.

Batch 1 and the batch each DiT replica reaches at the benchmark's concurrency (``--batch``, default 4: 8 in flight
over two replicas). With every stage single-threaded, the best the graph can do on ``--cores`` cores is
``cores / sum(per-image cost at the best batch)`` images/s, and no faster than one stage allows on its replicas
(``--dit-replicas`` for the DiT, one for the others). diffusers' pipeline one request at a time on two threads in
the same dtype (the benchmark's baseline) gives the ratio that ceiling allows; ``--bench-report`` reads the
benchmark's report and prints each engine run as a fraction of the ceiling.

    python benchmarks/qwen_image/ceiling.py [checkpoints/qwen_image-small] [--dtype bfloat16] [--size 128]
        [--batch 4] [--bench-report bench_image/bfloat16/128x128/image_bench_report.json] [--out ceiling.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # the checkout
from benchmarks.tools.ceiling_report import against_bench, print_costs, timed, write_report

from omni_serve.bench.image import ImageBenchConfig, build_image_workload
from omni_serve.kits.diffusion.messages import DenoiseCall, PromptEmbeds
from omni_serve.kits.diffusion.replica.programs import DenoiseCompute, DenoiseProgram
from omni_serve.models.qwen_image import QwenImageDecoder, QwenImageDenoiser, QwenImageTextEncoder

NEGATIVE = " "


def prompts(n: int) -> list[str]:
    """The benchmark's prompts (its workload, seed 0)."""
    cfg = ImageBenchConfig(url="http://unused", num_requests=n, size="128x128", negative_prompt=NEGATIVE,
                           baseline="none")
    return [r.prompt for r in build_image_workload(cfg)]


def encoder_seconds_per_image(model: QwenImageTextEncoder, texts: list[str]) -> float:
    def run():
        by_len: dict[int, list[str]] = {}
        for t in texts + [NEGATIVE] * len(texts):
            by_len.setdefault(model.token_count(t), []).append(t)
        for group in by_len.values():
            model.encode(group)
    return timed(run) / len(texts)


def dit_seconds_per_image(model: QwenImageDenoiser, embeds: list[PromptEmbeds], size: int, steps: int) -> float:
    programs = []
    for i, e in enumerate(embeds):
        p = DenoiseProgram(model, DenoiseCall(request_id=str(i), n=1, height=size, width=size, num_steps=steps,
                                              seed=i, true_cfg_scale=4.0))
        p.feed(e)
        programs.append(p)
    compute = DenoiseCompute(model)
    return timed(lambda: compute([p.work()[1] for p in programs])) * steps / len(embeds)


def vae_seconds_per_image(model: QwenImageDecoder, denoiser: QwenImageDenoiser, size: int, batch: int) -> float:
    latents = denoiser.initial_latents(batch, size, size, seed=0)
    return timed(lambda: model.decode(latents, size, size)) / batch


def baseline_seconds_per_image(checkpoint: str, dtype, texts: list[str], size: int, steps: int) -> float:
    from diffusers import QwenImagePipeline

    torch.set_num_threads(2)
    pipe = QwenImagePipeline.from_pretrained(checkpoint, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)

    def run(i: int) -> None:
        pipe(prompt=texts[i], negative_prompt=NEGATIVE, true_cfg_scale=4.0, height=size, width=size,
             num_inference_steps=steps, generator=torch.Generator().manual_seed(i))
    run(len(texts) - 1)
    start = time.perf_counter()
    for i in range(len(texts) - 1):
        run(i)
    return (time.perf_counter() - start) / (len(texts) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default="checkpoints/qwen_image-small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="requests per DiT replica at the bench's concurrency")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--dit-replicas", type=int, default=2)
    parser.add_argument("--baseline-requests", type=int, default=4, help="diffusers requests to time (0: skip)")
    parser.add_argument("--bench-report", help="an `omni-serve bench --mode image` report to set against the ceiling")
    parser.add_argument("--out", help="write the table as JSON here too")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    texts = prompts(max(args.batch, args.baseline_requests + 1))
    encoder = QwenImageTextEncoder(args.checkpoint, dtype=dtype)
    denoiser = QwenImageDenoiser(args.checkpoint, dtype=dtype, packed_linear=True)
    decoder = QwenImageDecoder(args.checkpoint, dtype=dtype)
    costs: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        negative = encoder.encode([NEGATIVE])[0]
        embeds = [PromptEmbeds(prompt_embeds=encoder.encode([t])[0], negative_embeds=negative) for t in texts]
        for batch in sorted({1, args.batch}):
            costs.setdefault("text_encoder", {})[batch] = encoder_seconds_per_image(encoder, texts[:batch])
            costs.setdefault("dit", {})[batch] = dit_seconds_per_image(denoiser, embeds[:batch], args.size,
                                                                       args.steps)
            costs.setdefault("vae", {})[batch] = vae_seconds_per_image(decoder, denoiser, args.size, batch)
    best = {stage: min(by_batch.values()) for stage, by_batch in costs.items()}
    total = sum(best.values())
    limits = {"cores": args.cores / total, "dit": args.dit_replicas / best["dit"],
              "text_encoder": 1 / best["text_encoder"], "vae": 1 / best["vae"]}
    ceiling = min(limits.values())
    print(f"per-image seconds on one thread ({args.size}x{args.size}, {args.steps} steps, true CFG, {args.dtype})")
    print_costs(costs, args.batch, total)
    print("ceiling: min(" + ", ".join(f"{k} {v:.3f}" for k, v in limits.items()) + f") = {ceiling:.3f} images/s")
    report = {"dtype": args.dtype, "costs_s_per_image": costs, "best_s_per_image": best, "limits": limits,
              "ceiling_images_per_s": ceiling}
    if args.baseline_requests:
        base = baseline_seconds_per_image(args.checkpoint, dtype, texts[:args.baseline_requests + 1], args.size,
                                          args.steps)
        report["diffusers_images_per_s"] = 1 / base
        report["ceiling_ratio"] = ceiling * base
        print(f"diffusers one at a time, 2 threads, {args.dtype}: {1 / base:.3f} images/s -> ceiling ratio "
              f"{ceiling * base:.2f}x")
    if args.bench_report:
        report["bench"] = against_bench(args.bench_report, ceiling, "images_per_s", "diffusers")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
