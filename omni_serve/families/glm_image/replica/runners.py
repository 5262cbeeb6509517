"""Stage runners of the GLM-Image graph (hosted by ``omni_serve.deployments.stage.StageDeployment``); the glyph
encoder's is the diffusion kit's ``TextEncoderRunner``.

Per request a runner builds the program from the stage's call (text, sizes, seed, settings); the edges declared
for the stage carry the tensors (``ar_dit``: prior tokens, ``text_encoder_dit``: glyph embeddings, ``dit_vae``:
final latents).
"""

from __future__ import annotations

from typing import AsyncIterator

from omni_serve.engines.sampling import SamplingParams
from omni_serve.families.glm_image.messages import GlmDenoiseCall, PriorCall
from omni_serve.families.glm_image.replica import programs as P
from omni_serve.kits.diffusion.replica.runners import VAERunner as QwenImageVAERunner
from omni_serve.graph.runner import StageRunner


class PriorRunner(StageRunner):
    async def run(self, engine, call: PriorCall) -> AsyncIterator:
        prompt = self.model.prompt(call.prompt, call.height, call.width)
        greedy = self.stage_spec.params.greedy
        sampling = SamplingParams(temperature=0.0) if greedy else self.model.sampling(call.seed)
        program = P.PriorSequence(self.model, prompt, sampling, self.engine_spec.ar.block_size)
        async for out in self.drive(engine, call.request_id, program):
            yield out


class DiTRunner(StageRunner):
    work_unit = "diffusion_steps"  # rows x steps left, as Qwen-Image counts them

    def batch_compute(self):
        return self.split_rows(P.GlmDenoiseCompute(self.model))

    async def run(self, engine, call: GlmDenoiseCall) -> AsyncIterator:
        program = P.GlmDenoiseProgram(self.model, call)
        async for out in self.drive(engine, call.request_id, program):
            yield out


class VAERunner(QwenImageVAERunner):
    """the diffusion kit's VAE runner (decode batched by size, images encoded off the engine thread) on GLM-Image's
    decoder, which has no tiling settings."""

    def adapter_options(self):
        return {}
