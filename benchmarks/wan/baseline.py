"""The Wan bench's baseline: diffusers' ``WanPipeline`` in this process, the video bench's requests one at a time.

Contract: ``load_pipeline(checkpoint, dtype)`` (local files only); ``DiffusersVideoBaseline(checkpoint, load,
threads, dtype)`` is ``benchmarks.diffusers_image.DiffusersImageBaseline``'s set-up (``torch.set_num_threads(threads)``,
default all cores; progress bar off) and its one-at-a-time loop, with a video request per call: ``generator =
torch.Generator().manual_seed(seed_i)`` (the server draws its noise the same way) and the request's
``pipeline_kwargs()``; the frames (``round(np * 255)`` as uint8, as the server's VAE stage does) are then encoded to
an MP4 by the server's own encoder (``omni_serve.api.video_out.encode_mp4``): the baseline delivers what a served job
does. A record's E2E is the pipeline call plus the encoding (``compute_s``: the pipeline call alone); its frames are
decoded back from that MP4 for the report's agreement check (not timed). A failed request is recorded, never
raised. ``from_config(VideoBenchConfig)`` is the baseline ``run_video_bench`` runs.
"""

from __future__ import annotations

import time

from benchmarks.diffusers_image import DiffusersImageBaseline
from omni_serve.bench.video import VideoRecord, VideoRequest, VideoRunResult, check_video


def load_pipeline(checkpoint: str, dtype):
    from diffusers import WanPipeline

    return WanPipeline.from_pretrained(checkpoint, local_files_only=True, dtype=dtype)


class DiffusersVideoBaseline(DiffusersImageBaseline):
    """diffusers' video pipeline in this process, requests one at a time, each video encoded to an MP4."""

    def run_one(self, req: VideoRequest) -> VideoRecord:
        import numpy as np
        import torch

        from omni_serve.api.video_out import encode_mp4

        rec = VideoRecord(index=req.index)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = self.pipe(generator=torch.Generator().manual_seed(req.seed), **req.pipeline_kwargs())
            rec.compute_s = time.perf_counter() - t0
            data = encode_mp4((np.asarray(out.frames[0]) * 255).round().astype(np.uint8), req.fps)
        except Exception as exc:  # noqa: BLE001 - a failed request is recorded, not fatal
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
            data = None
        rec.e2e_s = time.perf_counter() - t0
        if data is not None:
            check_video(rec, data, req)
        return rec

    def run(self, requests: list[VideoRequest], warmup: int = 1, progress_every: int = 10,
            label: str = "diffusers") -> VideoRunResult:
        done = super().run(requests, warmup=warmup, progress_every=progress_every, label=label)
        notes = done.notes + ["E2E: the pipeline call, then the frames encoded to an MP4 by the server's encoder"]
        return VideoRunResult(label=label, system="diffusers", mode="video", concurrency=1, wall_s=done.wall_s,
                              streaming=False, records=done.records, notes=notes)


def from_config(cfg) -> DiffusersVideoBaseline:
    return DiffusersVideoBaseline(cfg.checkpoint, load_pipeline, cfg.threads, cfg.baseline_dtype)
