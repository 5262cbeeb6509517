"""Per-request programs of the Qwen-Image-Edit stages that differ from the diffusion kit's
(``omni_serve.kits.diffusion.replica.programs``, whose text encoding, denoising and decoding programs this graph
otherwise runs).

- ``ConditionEncodeProgram`` (key: image size, and whether the latents are sampled): the input image, at its
  conditioning size, to its packed latents (``ConditionLatents`` downstream). Same-size images of different
  requests share one VAE call. Inpainting samples the latent distribution with the request's seed.
- ``EditDenoiseProgram``: the diffusion kit's ``DenoiseProgram`` whose rows carry the input image's latents after the
  noised ones (``condition``; its grid is part of the batching key). It starts once both the prompt embeddings
  and the image latents arrived.
- ``InpaintDenoiseProgram``: an edit with a mask, as ``QwenImageEditInpaintPipeline``: the schedule is cut to its
  last ``strength`` part, the first latents are the image latents noised to its first timestep, and after every
  step the unmasked area is put back to the image latents noised to the next timestep. It also waits for the
  mask (``InpaintMask``).
"""

from __future__ import annotations

import torch

from omni_serve.engines.batch import BatchProgram
from omni_serve.kits.diffusion.replica.programs import DenoiseProgram
from omni_serve.families.qwen_image_edit.messages import (
    ConditionLatents, EditDenoiseCall, InpaintMask, InputImage, PromptEmbeds,
)
from omni_serve.models.qwen_image_edit import inpaint_noise, pack_inpaint_mask


class ConditionEncodeProgram(BatchProgram):
    def __init__(self, sample_seed: int | None = None):
        self.pixels = None
        self.sample_seed = sample_seed

    def feed(self, item: InputImage) -> None:
        self.pixels = item.pixels

    def ready(self) -> bool:
        return self.pixels is not None and not self.done

    def work(self):
        return ("encode", *self.pixels.shape[:2], self.sample_seed is not None), (self.pixels, self.sample_seed)

    def complete(self, latents) -> list[ConditionLatents]:
        self.done = True
        self.pixels = None
        return [ConditionLatents(latents=latents)]


class EditDenoiseProgram(DenoiseProgram):
    req: EditDenoiseCall

    def feed(self, item: PromptEmbeds | ConditionLatents) -> None:
        if not isinstance(item, ConditionLatents):
            super().feed(item)
            return
        latents = item.latents.to(self.model.device, self.model.dtype)
        # every image of the request is conditioned on the same input image (the pipeline repeats its latents)
        self.condition = latents.unsqueeze(0).expand(self.req.n, *latents.shape)
        self.condition_grid = self.model.latent_grid(self.req.condition_height, self.req.condition_width)

    def ready(self) -> bool:
        return self.condition is not None and super().ready()


class InpaintDenoiseProgram(EditDenoiseProgram):
    def __init__(self, model, request: EditDenoiseCall, cache_session=None):
        super().__init__(model, request, cache_session)
        steps = len(self.timesteps)
        # the pipeline's get_timesteps: skip the first steps - strength x steps (rounded down); one step always runs
        start = int(max(steps - min(steps * request.strength, steps), 0))
        self.timesteps = self.scheduler.timesteps[start:]
        self.scheduler.set_begin_index(start)
        # the first latents need the image latents; the noise is drawn after the VAE encoder's sample
        self.noise = inpaint_noise(model, request.n, request.height, request.width, request.seed)
        self.latents = None
        self.mask: torch.Tensor | None = None

    def feed(self, item: PromptEmbeds | ConditionLatents | InpaintMask) -> None:
        if isinstance(item, InpaintMask):
            self.mask = pack_inpaint_mask(item.mask, self.req.n, self.model.vae_scale_factor,
                                          self.model.num_channels_latents).to(self.model.device, self.model.dtype)
            return
        super().feed(item)
        if isinstance(item, ConditionLatents):
            first = self.timesteps[:1].repeat(self.req.n)
            self.latents = self.scheduler.scale_noise(self.condition, first, self.noise)

    def ready(self) -> bool:
        return self.mask is not None and super().ready()

    def after_step(self) -> None:
        keep = self.condition
        if self.step_index < len(self.timesteps):
            keep = self.scheduler.scale_noise(keep, torch.tensor([self.timesteps[self.step_index]]), self.noise)
        self.latents = (1 - self.mask) * keep + self.mask * self.latents
