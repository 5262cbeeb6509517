"""Per-stage cost of one Qwen-Image-Edit request on this machine, alone, and the DiT's cost per row when requests
share a forward: the numbers behind the edit benchmark's ceiling (docs/qwen_image.md, "Image edits").

    .venv/bin/python benchmarks/qwen_image_edit/edit_cost.py [CHECKPOINT]   (default checkpoints/qwen_image_edit-small)

A 256x256 input image (conditioned at 1024x1024, as the pipeline does), a 128x128 output with true CFG (2 rows per
step): the prompt encoder and the VAE encoder at 1 and 2 torch threads, the DiT forward of 1, 2 and 4 requests
(2, 4, 8 rows) at 2 threads, the VAE decode. Each timing is the mean of 3 runs after one warm-up.
"""

from __future__ import annotations

import io
import sys
import time

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from omni_serve.bench.image import input_png
from omni_serve.families.qwen_image_edit.frontend import condition_size
from omni_serve.models.qwen_image import DenoiseRow, QwenImageDecoder, QwenImageDenoiser
from omni_serve.models.qwen_image_edit import QwenImageConditionEncoder, QwenImageEditTextEncoder


def timed(fn, threads: int, reps: int = 3) -> float:
    torch.set_num_threads(threads)
    with torch.inference_mode():
        fn()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
    return (time.perf_counter() - start) / reps


def main(checkpoint: str) -> None:
    image = Image.open(io.BytesIO(input_png(256, 256, 0))).convert("RGB")
    width, height = condition_size(*image.size)
    cond = VaeImageProcessor(vae_scale_factor=16).resize(image, height, width)
    pixels = torch.from_numpy(np.asarray(cond).copy())
    prompt = "A photo of a red cat on a blue sea"
    text, vae_in = QwenImageEditTextEncoder(checkpoint), QwenImageConditionEncoder(checkpoint)
    dit, vae_out = QwenImageDenoiser(checkpoint), QwenImageDecoder(checkpoint)
    print(f"conditioning {width}x{height}, output 128x128")
    for threads in (1, 2):
        t_text = timed(lambda: text.encode([(prompt, cond)]), threads)
        t_vae = timed(lambda: vae_in.encode([(pixels, None)]), threads)
        print(f"{threads} thread(s): prompt encode {t_text:.2f} s, VAE encode {t_vae:.2f} s")
    embeds = text.encode([(prompt, cond)])[0]
    latents = vae_in.encode([(pixels, None)])[0]
    grid, cond_grid = dit.latent_grid(128, 128), dit.latent_grid(height, width)
    noise = dit.initial_latents(1, 128, 128, 0)[0]
    for requests in (1, 2, 4):
        rows = [DenoiseRow(noise, torch.tensor(500.0), embeds, None, latents) for _ in range(2 * requests)]
        t = timed(lambda: dit.predict(rows, grid, condition_grid=cond_grid), 2)
        print(f"DiT forward, {requests} request(s) ({2 * requests} rows), 2 threads: {t:.2f} s = "
              f"{t / (2 * requests):.2f} s/row")
    t = timed(lambda: vae_out.decode(noise[None], 128, 128), 1)
    print(f"VAE decode 128x128, 1 thread: {t:.3f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "checkpoints/qwen_image_edit-small")
