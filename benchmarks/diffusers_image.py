"""The in-process diffusers baseline shared by the image families' benches: a pipeline in this process, the image
bench's requests one at a time.

Contract: ``DiffusersImageBaseline(checkpoint, load, threads, dtype, glm)`` sets ``torch.set_num_threads(threads)``
(default: all cores), then ``load(checkpoint, torch_dtype)`` gives the family's pipeline (local files only; each
family's ``benchmarks/<family>/baseline.py`` names its own); progress bar off. ``run(requests, warmup,
progress_every)`` is an ``omni_serve.bench.image.ImageBaseline``: ``warmup`` unmeasured requests, then each request
with ``generator = torch.Generator().manual_seed(seed_i)`` (the server draws its noise the same way) and the
request's ``pipeline_kwargs(glm)`` (the server's values; without a negative prompt neither side runs CFG, and the
baseline gets ``true_cfg_scale=1`` then: same result, it only silences diffusers' warning; ``glm``: the CFG scale is
``guidance_scale``, 1.5 by default on both sides). Images: ``round(np * 255)`` as uint8, as the server's VAE stage
does; a failed request is recorded, never raised.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from omni_serve.bench.client import progress_logger
from omni_serve.bench.image import ImageRecord, ImageRequest, ImageRunResult


class DiffusersImageBaseline:
    """A family's diffusers pipeline in this process, requests one at a time."""

    def __init__(self, checkpoint: str, load: Callable[[str, Any], Any], threads: int | None = None,
                 dtype: str = "float32", glm: bool = False):
        import torch

        self.threads = threads or os.cpu_count() or 1
        self.dtype = dtype
        self.glm = glm
        torch.set_num_threads(self.threads)
        self.pipe = load(checkpoint, getattr(torch, dtype))
        self.pipe.set_progress_bar_config(disable=True)

    def run_one(self, req: ImageRequest) -> ImageRecord:
        import numpy as np
        import torch

        rec = ImageRecord(index=req.index, cache_mode="off")
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.pipe(generator=torch.Generator().manual_seed(req.seed), **req.pipeline_kwargs(self.glm))
            rec.images = list((np.asarray(out.images) * 255).round().astype(np.uint8))
            rec.num_images = len(rec.images)
            rec.computed_steps, rec.cached_steps = [req.steps] * rec.num_images, [0] * rec.num_images
            rec.ok = True
        except Exception as exc:  # noqa: BLE001 - a failed request is recorded, not fatal
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.e2e_s = time.perf_counter() - t0
        return rec

    def run(self, requests: list[ImageRequest], warmup: int = 1, progress_every: int = 10,
            label: str = "diffusers") -> ImageRunResult:
        for req in requests[:warmup]:
            self.run_one(req)
        on_done = progress_logger(label, len(requests), progress_every)
        records = []
        t_run = time.perf_counter()
        for req in requests:
            start = time.perf_counter() - t_run
            records.append(self.run_one(req))
            records[-1].start_s = start
            on_done(records[-1])
        wall = time.perf_counter() - t_run
        note = (f"diffusers {type(self.pipe).__name__} in process, one request at a time, {self.threads} torch threads, "
                f"{self.dtype}")
        return ImageRunResult(label=label, system="diffusers", mode="image", concurrency=1, wall_s=wall,
                              streaming=False, records=records, notes=[note])


def from_loader(load: Callable[[str, Any], Any], glm: bool = False) -> Callable[[Any], DiffusersImageBaseline]:
    """The baseline factory ``run_image_bench`` calls with its ``ImageBenchConfig`` (checkpoint, threads, dtype)."""

    def from_config(cfg) -> DiffusersImageBaseline:
        return DiffusersImageBaseline(cfg.checkpoint, load, cfg.threads, cfg.baseline_dtype, glm=glm)

    return from_config
