"""How much step-level batching can pay for the Qwen-Image DiT on this machine (quoted in docs/qwen_image.md).

Times one transformer forward of the `small` checkpoint over B rows (one row = one image at one denoising
step, ~14 text tokens) for several image sizes and thread counts, through the same ``QwenImageDenoiser.predict``
the DiT stage runs. ms/row at B=1 is what a one-request-at-a-time pipeline pays per step and CFG branch;
the best ms/row at larger B bounds what batching can gain when the DiT is the whole cost.

    python benchmarks/qwen_image/dit_batching.py [checkpoints/qwen_image-small] [--sizes 64,128,256] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import time

import torch

from omni_serve.models.qwen_image import DenoiseRow, QwenImageDenoiser


def time_forward(model: QwenImageDenoiser, size: int, batch: int, repeats: int = 3) -> float:
    grid = model.latent_grid(size, size)
    gen = torch.Generator().manual_seed(0)
    rows = [DenoiseRow(torch.randn(grid[0] * grid[1], model.num_channels_latents * 4, generator=gen),
                       torch.tensor(500.0), torch.randn(14, model.transformer.config.joint_attention_dim,
                                                        generator=gen)) for _ in range(batch)]
    with torch.inference_mode():
        model.predict(rows, grid)  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            model.predict(rows, grid)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", default="checkpoints/qwen_image-small")
    parser.add_argument("--sizes", default="64,128,256")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--batches", default="1,2,8,16")
    args = parser.parse_args()
    model = QwenImageDenoiser(args.checkpoint)
    batches = [int(b) for b in args.batches.split(",")]
    print("threads  size  " + "  ".join(f"B={b:<2} ms/row" for b in batches) + "  best gain vs B=1")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for size in (int(s) for s in args.sizes.split(",")):
            per_row = [time_forward(model, size, b) * 1000 / b for b in batches]
            cells = "  ".join(f"{v:11.1f}" for v in per_row)
            print(f"{threads:7d}  {size:4d}  {cells}  {per_row[0] / min(per_row):.2f}x")


if __name__ == "__main__":
    main()
