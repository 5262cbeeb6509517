"""Adapters over diffusers' Wan 2.1 image-to-video components (``WanImageToVideoPipeline``), beside the text-to-video
ones (``omni_serve.models.wan``: the text encoder, the denoiser and the decoder serve both pipelines). Each stage
loads only its own part of the checkpoint.

Contract (a checkpoint directory in the image-to-video layout, as ``WanImageToVideoPipeline.from_pretrained`` reads):

- ``WanImageEncoder(dir)``: ``encode(images) -> list[Tensor[L, D]]``: each input image (uint8 [H, W, 3], any sizes)
  to its CLIP tokens, the pipeline's own ``encode_image`` (the processor's resize, crop and normalization, then the
  vision tower's second-to-last hidden states), batched. The DiT attends to them beside the prompt.
- ``WanConditionEncoder(dir)``: ``encode(items) -> list[Tensor[4 + C, F', H', W']]``: each (first frame uint8
  [H, W, 3], frame count) to the pipeline's first-frame conditioning: the frame followed by ``num_frames - 1`` black
  frames through the VAE's encoder (the latent distribution's mode), normalised with the VAE's statistics, after the
  mask that marks the first latent frame as given (``WanImageToVideoPipeline.prepare_latents``). Items must share
  one size and frame count; one VAE call encodes them all. The frame must already have the video's size: the
  pipeline's resize to (height, width) is then a copy, and the ingress refuses other sizes.

The denoiser is ``omni_serve.models.wan.WanDenoiser`` on the image-to-video transformer: its rows carry this
conditioning (``DenoiseRow.condition``, stacked on the noise's channels) and the CLIP tokens (``DenoiseRow.image``).
Wan 2.2's image-to-video (``expand_timesteps``, a second transformer) and first-last-frame conditioning
(``last_image``) are not covered.
"""

from __future__ import annotations

import os

import numpy as np
import torch


def _partial_pipeline(**components):
    """A ``WanImageToVideoPipeline`` holding only ``components`` (the rest None): its helpers work on those."""
    from diffusers import WanImageToVideoPipeline

    parts = {"tokenizer": None, "text_encoder": None, "vae": None, "scheduler": None}
    parts.update(components)
    return WanImageToVideoPipeline(**parts)


def _images(frames: list[torch.Tensor]):
    from PIL import Image

    return [Image.fromarray(np.ascontiguousarray(f.numpy())) for f in frames]


class WanImageEncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from transformers import CLIPImageProcessor, CLIPVisionModel

        self.device = torch.device(device)
        processor = CLIPImageProcessor.from_pretrained(os.path.join(checkpoint_dir, "image_processor"))
        encoder = CLIPVisionModel.from_pretrained(os.path.join(checkpoint_dir, "image_encoder"),
                                                  dtype=dtype).to(self.device).eval()
        self.pipe = _partial_pipeline(image_processor=processor, image_encoder=encoder)
        self.modules = {"image_encoder": encoder}

    @torch.inference_mode()
    def encode(self, frames: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(self.pipe.encode_image(_images(frames), self.device))


class WanConditionEncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from diffusers import AutoencoderKLWan

        self.device = torch.device(device)
        self.vae = AutoencoderKLWan.from_pretrained(checkpoint_dir, subfolder="vae",
                                                    torch_dtype=dtype).to(self.device).eval()
        self.pipe = _partial_pipeline(vae=self.vae)
        cfg = self.vae.config
        self.temporal, self.spatial = cfg.scale_factor_temporal, cfg.scale_factor_spatial
        self.latents_mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(self.device)
        self.inv_latents_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(self.device)
        self.modules = {"vae": self.vae}

    def mask(self, num_frames: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's first-frame mask [1, temporal, F', H', W']: ones on the given first frame's latent."""
        h, w, t = height // self.spatial, width // self.spatial, self.temporal
        mask = torch.ones(1, 1, num_frames, h, w)
        mask[:, :, 1:] = 0
        first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=t)  # the first frame stands for t frames
        mask = torch.concat([first, mask[:, :, 1:]], dim=2)
        return mask.view(1, -1, t, h, w).transpose(1, 2).to(self.device)

    @torch.inference_mode()
    def encode(self, items: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        if len({(tuple(f.shape), n) for f, n in items}) != 1:
            raise ValueError("one call encodes first frames of one size and frame count")
        height, width = items[0][0].shape[:2]
        num_frames = items[0][1]
        image = torch.cat([self.pipe.video_processor.preprocess(im, height=height, width=width)
                           for im in _images([f for f, _ in items])]).to(self.device, torch.float32).unsqueeze(2)
        n = image.shape[0]
        video = torch.cat([image, image.new_zeros(n, 3, num_frames - 1, height, width)], dim=2)
        latents = self.vae.encode(video.to(self.vae.dtype)).latent_dist.mode()  # the pipeline's "argmax"
        latents = (latents.to(torch.float32) - self.latents_mean) * self.inv_latents_std
        mask = self.mask(num_frames, height, width).to(latents.dtype).expand(n, -1, -1, -1, -1)
        return list(torch.concat([mask, latents], dim=1))
