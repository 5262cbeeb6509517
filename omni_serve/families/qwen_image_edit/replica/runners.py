"""Stage runners of the Qwen-Image-Edit graph that differ from the diffusion kit's (the VAE decoder is the diffusion kit's
``VAERunner``). Each runs the ``BatchEngine`` and adapter its declaration names (``graph.GRAPH``).
"""

from __future__ import annotations

from typing import AsyncIterator

from PIL import Image

from omni_serve.kits.diffusion.replica.programs import TextEncodeProgram
from omni_serve.kits.diffusion.replica.runners import DiTRunner
from omni_serve.families.qwen_image_edit.messages import EditDenoiseCall, EncodeImageCall, TextEncodeCall
from omni_serve.families.qwen_image_edit.replica.programs import (
    ConditionEncodeProgram, EditDenoiseProgram, InpaintDenoiseProgram,
)
from omni_serve.graph.runner import StageRunner


class EditTextEncoderRunner(StageRunner):
    """The prompt (and negative prompt) encoded with the input image, as the edit pipeline's ``encode_prompt``."""

    def batch_compute(self):
        return self.model.encode

    async def run(self, engine, call: TextEncodeCall) -> AsyncIterator:
        image = await self.io.read_one("ingress_text_encoder", call.request_id)
        pil = Image.fromarray(image.pixels.numpy())
        texts = [call.prompt] + ([call.negative_prompt] if call.negative_prompt is not None else [])
        program = TextEncodeProgram([(t, pil) for t in texts], [self.model.token_count(t, *pil.size) for t in texts])
        async for out in self.drive(engine, call.request_id, program, reads=None):  # image read above
            yield out


class ConditionEncoderRunner(StageRunner):
    def batch_compute(self):
        return self.model.encode

    async def run(self, engine, call: EncodeImageCall) -> AsyncIterator:
        program = ConditionEncodeProgram(call.sample_seed)
        async for out in self.drive(engine, call.request_id, program):
            yield out


class EditDiTRunner(DiTRunner):
    """Edits (and, with a strength, inpainting: the mask comes on ingress_dit) on the diffusion kit's denoiser."""

    async def run(self, engine, call: EditDenoiseCall) -> AsyncIterator:
        inpaint = call.strength is not None
        program = (InpaintDenoiseProgram if inpaint else EditDenoiseProgram)(
            self.model, call, self.cache_session(call.cache, call.n))
        reads = ("text_encoder_dit", "vae_encoder_dit") + (("ingress_dit",) if inpaint else ())
        async for out in self.drive(engine, call.request_id, program, reads=reads):
            yield out
