"""Ingress side of a video graph: OpenAI's Videos API, a job API over the graph's stages.

Contract: ``VideosFrontend(spec, stages)`` (a family subclasses it, giving ``checks``: a ``VideoRequestChecks``)
serves ``POST /v1/videos`` (multipart, as the official client sends it, or JSON: a job is created ``queued`` and its
object returned at once; ``input_reference``, a multipart file, the first frame of an image-to-video model, is
refused unless the family's ``reference_inputs`` takes it, and kept with the job as an input file for
``stage_inputs`` to hand the stages), ``GET /v1/videos/{video_id}`` (the job object: ``status``, ``progress`` from
the DiT's steps), ``GET /v1/videos`` (the caller's jobs, newest first, by pages: ``after``, ``limit``, ``order``),
``GET /v1/videos/{video_id}/content`` (the MP4, or with ``variant=thumbnail`` its first frame as a PNG) and
``DELETE /v1/videos/{video_id}`` (the job and its file deleted, its run cancelled wherever it runs). Jobs live in
the graph's job store (``spec.jobs``) and are run by the ingress replicas (``VideoJobs``): any replica answers for
any job. A job's owner is its API key (a digest of it; every caller is one owner without keys): another key's job
id answers 404, as an unknown one does. Bad requests are 400s before a job is created; past
``jobs.max_queued_per_key`` queued or running jobs a key gets a 429.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
from typing import Any, Literal

from fastapi import UploadFile
from pydantic import BaseModel, Field

from omni_serve.api.errors import bad_request, not_found, too_many_requests
from omni_serve.api.guards import owner_of as owner_from_headers
from omni_serve.api.video_out import MP4_MEDIA_TYPE
from omni_serve.api.videos import (
    VideoCreateRequest, VideoDeleted, VideoList, Video, frame_count, video_list, video_object,
)
from omni_serve.graph.frontend import ByteStream, Frontend, RawReply, RequestContext, Route
from omni_serve.graph.messages import Message
from omni_serve.kits.diffusion.frontend import check_size
from omni_serve.jobs import COMPLETED, Job, QueueFull
from omni_serve.kits.diffusion.messages import (
    DenoiseDone, DenoiseProgress, TextEncodeCall, VideoDecodeCall, VideoDenoiseCall, VideosEncoded,
)
from omni_serve.kits.diffusion.video_jobs import VideoJobs
from omni_serve.request_ids import new_request_id

ID_PATTERN = r"^video_[0-9a-f]{1,64}$"


class VideoCreateForm(VideoCreateRequest):
    input_reference: UploadFile | None = Field(default=None, description=(
        "Image-to-video models: the video's first frame, a PNG, JPEG or WebP image of the video's size (the size "
        "when `size` is left out). Text-to-video models refuse it."))


class VideoRef(BaseModel):
    video_id: str = Field(pattern=ID_PATTERN, description="The video job's id.")


class VideoContent(VideoRef):
    variant: Literal["video", "thumbnail"] = Field("video", description="The MP4, or its first frame as a PNG.")


class VideoPage(BaseModel):
    after: str | None = Field(None, pattern=ID_PATTERN, description="The last id of the page before this one.")
    limit: int = Field(20, ge=1, le=100, description="Jobs per page.")
    order: Literal["asc", "desc"] = Field("desc", description="By creation time.")


class VideoRequestChecks:
    """A video graph's limits on a request, as 400s: model, size (a multiple of ``size_multiple``), frame count
    (``temporal * k + 1``, at most ``max_frames``), steps. ``resolve`` turns a request into the job's settings."""

    def __init__(self, spec: Any, size_multiple: int, temporal: int):
        self.spec, self.multiple, self.temporal = spec, size_multiple, temporal
        self.check_size(*spec.default_dimensions(), param="default_size")

    def check_size(self, width: int, height: int, param: str = "size") -> None:
        check_size(self.spec, self.multiple, width, height, param)

    def resolve(self, req: VideoCreateRequest, reference_size: tuple[int, int] | None = None) -> dict[str, Any]:
        """The job's settings, every default filled in (the seed drawn now, so a retried job gives the same video).
        With a reference image (``reference_size``: its width and height) the video has its size."""
        s = self.spec
        if req.model is not None and req.model != s.model_name:
            raise bad_request(f"The model {req.model!r} does not exist; this server serves {s.model_name!r}.",
                              param="model", code="model_not_found")
        width, height = req.dimensions() or reference_size or s.default_dimensions()
        if reference_size is not None and reference_size != (width, height):
            raise bad_request(f"input_reference is {reference_size[0]}x{reference_size[1]}: it must have the "
                              f"video's size, {width}x{height} (or leave size out).", param="input_reference")
        self.check_size(width, height)
        fps = req.fps or s.default_fps
        seconds = int(req.seconds) if req.seconds is not None else s.default_seconds
        frames = req.num_frames if req.num_frames is not None else frame_count(seconds, fps, self.temporal)
        if (frames - 1) % self.temporal:
            raise bad_request(f"num_frames {frames} is not supported: it must be {self.temporal}k + 1.",
                              param="num_frames")
        if frames > s.max_frames:
            raise bad_request(f"{frames} frames ({seconds} s at {fps} fps) is too long: at most {s.max_frames}.",
                              param="num_frames" if req.num_frames is not None else "seconds")
        steps = req.num_inference_steps or s.default_steps
        if steps > s.max_steps:
            raise bad_request(f"num_inference_steps {steps} is over the limit of {s.max_steps}.",
                              param="num_inference_steps")
        guidance = s.default_guidance_scale if req.guidance_scale is None else req.guidance_scale
        return {"model": s.model_name, "prompt": req.prompt, "size": f"{width}x{height}",
                "seconds": str(max(1, round((frames - 1) / fps)) if req.num_frames is not None else seconds),
                "width": width, "height": height, "fps": fps, "num_frames": frames, "num_inference_steps": steps,
                "guidance_scale": guidance, "negative_prompt": req.negative_prompt,
                "output_format": req.output_format or "mp4",
                "seed": req.seed if req.seed is not None else random.randrange(2**31)}


def owner_of(ctx: RequestContext) -> str:
    """The job owner of a request: a digest of its API key (never the key itself), or 'anonymous'."""
    return owner_from_headers(ctx.headers)


class VideosFrontend(Frontend):
    routes = (
        Route("/v1/videos", "videos", "videos_create", VideoCreateForm, form=True,
              summary="Create a video job from a prompt (OpenAI videos.create)."),
        Route("/v1/videos", "videos_list", "videos_list", VideoPage, method="GET",
              summary="List the caller's video jobs (OpenAI videos.list)."),
        Route("/v1/videos/{video_id}", "videos_retrieve", "videos_retrieve", VideoRef, method="GET",
              summary="A video job's status and progress (OpenAI videos.retrieve)."),
        Route("/v1/videos/{video_id}/content", "videos_content", "videos_content", VideoContent, method="GET",
              summary="A completed video's MP4, or its thumbnail (OpenAI videos.download_content)."),
        Route("/v1/videos/{video_id}", "videos_delete", "videos_delete", VideoRef, method="DELETE",
              summary="Delete a video job, cancelling it if it runs (OpenAI videos.delete)."),
    )
    checks: VideoRequestChecks

    def __init__(self, spec: Any, stages):
        super().__init__(spec, stages)
        self.jobs = VideoJobs(spec.jobs.store(), self.run_job, max_running=spec.max_running_jobs)

    async def start(self) -> None:
        await self.jobs.start()

    async def close(self) -> None:
        await self.jobs.close()

    # -- routes --------------------------------------------------------------------------------------------------
    async def videos_create(self, req: VideoCreateForm, ctx: RequestContext) -> Video:
        reference_size, inputs = await self.reference_inputs(req)
        settings = self.checks.resolve(req, reference_size)
        try:
            job = await self.jobs.create(owner_of(ctx), settings, max_queued=self.spec.jobs.max_queued_per_key,
                                         inputs=inputs)
        except QueueFull as err:
            raise too_many_requests(str(err), retry_after_s=30) from None
        return video_object(job)

    async def videos_retrieve(self, ref: VideoRef, ctx: RequestContext) -> Video:
        return video_object(await self._job(ref.video_id, ctx))

    async def videos_list(self, page: VideoPage, ctx: RequestContext) -> VideoList:
        jobs, more = await self.jobs.list(owner_of(ctx), after=page.after, limit=page.limit, order=page.order)
        return video_list(jobs, more)

    async def videos_content(self, ref: VideoContent, ctx: RequestContext):
        job = await self._job(ref.video_id, ctx)
        path = self.jobs.result_path(job) if job.status == COMPLETED else None
        if path is None or not os.path.exists(path):
            raise bad_request(f"Video {job.id} is {job.status}: its content exists once it is completed.",
                              param="video_id", code="video_not_ready")
        if ref.variant == "thumbnail":
            return RawReply(await asyncio.to_thread(_thumbnail, path), "image/png")
        media = MP4_MEDIA_TYPE if job.request.get("output_format", "mp4") == "mp4" else "application/octet-stream"
        return ByteStream(_file_chunks(path), media)

    async def videos_delete(self, ref: VideoRef, ctx: RequestContext) -> VideoDeleted:
        if await self.jobs.delete(ref.video_id, owner_of(ctx)) is None:
            raise not_found(f"No video with id {ref.video_id!r}.")
        return VideoDeleted(id=ref.video_id)

    async def _job(self, video_id: str, ctx: RequestContext) -> Job:
        job = await self.jobs.get(video_id, owner_of(ctx))
        if job is None:
            raise not_found(f"No video with id {video_id!r}.")
        return job

    async def reference_inputs(self, req: VideoCreateForm) -> tuple[tuple[int, int] | None, dict[str, bytes]]:
        """(the reference image's width and height, the job's input files): a text-to-video graph takes none; an
        image-to-video one checks ``input_reference`` here (a 400 when it is missing or unreadable)."""
        if req.input_reference is not None:
            raise bad_request(f"{self.spec.model_name} generates videos from a prompt alone: input_reference is for "
                              "image-to-video models.", param="input_reference")
        return None, {}

    # -- a job through the stages --------------------------------------------------------------------------------
    async def stage_inputs(self, job: Job) -> dict[str, Message]:
        """The payloads the ingress writes to the graph's ingress edges for ``job`` (its input files, read back)."""
        return {}

    def calls(self, rid: str, s: dict[str, Any]) -> dict[str, Any]:
        """The stage calls of a job's settings (``VideoRequestChecks.resolve``)."""
        cfg = s["guidance_scale"] > 1  # as diffusers' video pipelines: CFG above 1, an empty negative prompt
        return {
            "text_encoder": TextEncodeCall(request_id=rid, prompt=s["prompt"],
                                           negative_prompt=(s["negative_prompt"] or "") if cfg else None),
            "dit": VideoDenoiseCall(request_id=rid, n=1, height=s["height"], width=s["width"],
                                    num_frames=s["num_frames"], num_steps=s["num_inference_steps"], seed=s["seed"],
                                    true_cfg_scale=s["guidance_scale"] if cfg else 1.0),
            "vae": VideoDecodeCall(request_id=rid, fps=s["fps"], output_format=s.get("output_format", "mp4")),
        }

    async def run_job(self, job: Job, progress) -> bytes:
        rid = new_request_id("video")
        video = None
        inputs = await self.stage_inputs(job)
        async for _, out in self.stages.stream(rid, self.calls(rid, job.request), self.spec.job_timeout_s,
                                               inputs=inputs or None):
            if isinstance(out, DenoiseProgress):  # denoising is most of the work: 0-95%, the VAE the rest
                await progress(95 * out.step // out.num_steps)
            elif isinstance(out, DenoiseDone):
                await progress(95)
            elif isinstance(out, VideosEncoded):
                video = out.videos[0]
        if video is None:
            raise RuntimeError(f"the graph ended job {job.id} without a video (request {rid})")
        return video


def _file_chunks(path: str, size: int = 1 << 20):
    async def chunks():
        with open(path, "rb") as f:
            while True:
                chunk = await asyncio.to_thread(f.read, size)
                if not chunk:
                    return
                yield chunk
    return chunks()


def _thumbnail(path: str) -> bytes:
    """The first frame of a job's file (an MP4, or a NumPy archive's exact frames) as a PNG."""
    from PIL import Image

    if path.endswith(".npz"):
        import numpy as np

        frame = np.load(path)["frames"][0]
    else:
        import av

        with av.open(path) as container:
            frame = next(container.decode(video=0)).to_ndarray(format="rgb24")
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG")
    return out.getvalue()


__all__ = ["VideoCreateForm", "VideosFrontend", "VideoRequestChecks", "owner_of"]
