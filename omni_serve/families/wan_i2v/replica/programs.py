"""Per-request programs of the Wan image-to-video stages that differ from the diffusion kit's
(``omni_serve.kits.diffusion.replica.programs``, whose text encoding, denoising and decoding programs this graph
otherwise runs).

- ``ImageEncodeProgram`` (one key: the image processor brings every image to one size): the first frame to its
  image tokens (``ImageEmbeds`` downstream); any requests' frames share one CLIP call.
- ``FirstFrameEncodeProgram`` (key: size and frame count): the first frame to its conditioning latents
  (``FirstFrameLatents``); same-key frames share one VAE call.
- ``ImageToVideoDenoiseProgram``: the diffusion kit's ``DenoiseProgram`` whose rows carry the first frame's latents
  (``condition``) and image tokens (``image_embeds``), the same on the conditional and unconditional rows, as the
  pipeline's loop. It starts once the prompt embeddings, the tokens and the latents arrived.
"""

from __future__ import annotations

from omni_serve.engines.batch import BatchProgram
from omni_serve.families.wan_i2v.messages import FirstFrameLatents, ImageEmbeds, InputImage, PromptEmbeds
from omni_serve.kits.diffusion.replica.programs import DenoiseProgram


class ImageEncodeProgram(BatchProgram):
    """The first frame (``InputImage``) to one encoder's output; this one CLIP's tokens."""

    def __init__(self):
        self.pixels = None

    def feed(self, item: InputImage) -> None:
        self.pixels = item.pixels

    def ready(self) -> bool:
        return self.pixels is not None and not self.done

    def work(self):
        return ("image",), self.pixels

    def complete(self, result) -> list:
        self.done = True
        self.pixels = None
        return [self.output(result)]

    def output(self, result):
        return ImageEmbeds(embeds=result)


class FirstFrameEncodeProgram(ImageEncodeProgram):
    """The first frame to its conditioning latents, encoded with ``num_frames - 1`` black frames after it."""

    def __init__(self, num_frames: int):
        super().__init__()
        self.num_frames = num_frames

    def work(self):
        return ("first_frame", *self.pixels.shape[:2], self.num_frames), (self.pixels, self.num_frames)

    def output(self, result):
        return FirstFrameLatents(latents=result)


class ImageToVideoDenoiseProgram(DenoiseProgram):
    def feed(self, item: PromptEmbeds | ImageEmbeds | FirstFrameLatents) -> None:
        if isinstance(item, ImageEmbeds):
            self.image_embeds = item.embeds.to(self.model.device, self.model.dtype)
        elif isinstance(item, FirstFrameLatents):
            latents = item.latents.to(self.model.device)
            # every video of the request starts from the same frame (the pipeline repeats its latents)
            self.condition = latents.unsqueeze(0).expand(self.req.n, *latents.shape)
        else:
            super().feed(item)

    def ready(self) -> bool:
        return self.image_embeds is not None and self.condition is not None and super().ready()
