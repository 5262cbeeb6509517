"""Stage runners of the Wan image-to-video graph that differ from the diffusion kit's (its text encoder and VAE
decoder are the kit's). Each runs the ``BatchEngine`` and adapter its declaration names (``graph.GRAPH``).
"""

from __future__ import annotations

from typing import AsyncIterator

from omni_serve.families.wan_i2v.messages import EncodeFirstFrameCall, EncodeImageCall, VideoDenoiseCall
from omni_serve.families.wan_i2v.replica.programs import (
    FirstFrameEncodeProgram, ImageEncodeProgram, ImageToVideoDenoiseProgram,
)
from omni_serve.graph.runner import StageRunner
from omni_serve.kits.diffusion.replica.runners import VideoDiTRunner


class ImageEncoderRunner(StageRunner):
    def batch_compute(self):
        return self.model.encode

    async def run(self, engine, call: EncodeImageCall) -> AsyncIterator:
        async for out in self.drive(engine, call.request_id, ImageEncodeProgram()):
            yield out


class FirstFrameEncoderRunner(StageRunner):
    def batch_compute(self):
        return self.model.encode

    async def run(self, engine, call: EncodeFirstFrameCall) -> AsyncIterator:
        async for out in self.drive(engine, call.request_id, FirstFrameEncodeProgram(call.num_frames)):
            yield out


class ImageToVideoDiTRunner(VideoDiTRunner):
    """The kit's video DiT whose programs wait for the first frame's tokens and latents too."""

    async def run(self, engine, call: VideoDenoiseCall) -> AsyncIterator:
        program = ImageToVideoDenoiseProgram(self.model, call)
        async for out in self.drive(engine, call.request_id, program):
            yield out
