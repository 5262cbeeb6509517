"""Ingress side of the Wan image-to-video graph: OpenAI's Videos API (``omni_serve.kits.diffusion.video_frontend``)
where ``input_reference`` is required: the video's first frame, an image of the video's size (the size when the
request gives none). It is checked (file size, format, pixels: 400s) when the job is created and kept with the job
as a PNG; a run reads it back and writes it to both image encoders' ingress edges. Wan's size and frame rules are
the text-to-video graph's, read from the checkpoint's configs (no model loaded here)."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import torch

from omni_serve.api.errors import bad_request
from omni_serve.api.media import decode_image_bytes, read_upload
from omni_serve.families.wan_i2v.messages import EncodeFirstFrameCall, EncodeImageCall, InputImage
from omni_serve.jobs import Job
from omni_serve.kits.diffusion.video_frontend import VideoCreateForm, VideoRequestChecks, VideosFrontend
from omni_serve.models.wan_layout import size_rules

REFERENCE = "input_reference.png"  # the job's input file


class WanImageToVideoFrontend(VideosFrontend):
    def __init__(self, spec, stages):
        super().__init__(spec, stages)
        self.checks = VideoRequestChecks(spec, *size_rules(spec.checkpoint))

    async def reference_inputs(self, req: VideoCreateForm) -> tuple[tuple[int, int], dict[str, bytes]]:
        if req.input_reference is None:
            raise bad_request(f"{self.spec.model_name} generates a video from its first frame: input_reference "
                              "is required (a PNG, JPEG or WebP image of the video's size).", param="input_reference")
        raw = await read_upload(req.input_reference, self.spec.max_input_bytes, "input_reference")

        def canonical():
            image = decode_image_bytes(raw, max_pixels=self.spec.max_pixels, param="input_reference")
            out = io.BytesIO()
            image.save(out, format="PNG")
            return image.size, out.getvalue()
        size, png = await asyncio.to_thread(canonical)
        return size, {REFERENCE: png}

    async def stage_inputs(self, job: Job) -> dict[str, InputImage]:
        raw = await self.jobs.read_input(job, REFERENCE)

        def pixels():
            from PIL import Image

            with Image.open(io.BytesIO(raw)) as image:
                return torch.from_numpy(np.asarray(image.convert("RGB")).copy())
        frame = InputImage(pixels=await asyncio.to_thread(pixels))
        return {"ingress_image_encoder": frame, "ingress_vae_encoder": frame}

    def calls(self, rid: str, s: dict):
        return {**super().calls(rid, s), "image_encoder": EncodeImageCall(request_id=rid),
                "vae_encoder": EncodeFirstFrameCall(request_id=rid, num_frames=s["num_frames"])}
