"""Adapters over diffusers' Qwen-Image-Edit components that Qwen-Image does not have: the prompt encoder that sees
the input image, and the VAE encoder of the input image. The DiT and the VAE decoder are Qwen-Image's
(``omni_serve.models.qwen_image``; the DiT takes the input image's latents as ``DenoiseRow.condition``).

Contract (a checkpoint directory in the diffusers layout, as ``QwenImageEditPipeline.from_pretrained`` reads):

- ``EditPromptProcessor.from_pretrained(dir)``: what transformers' ``Qwen2VLProcessor`` does for the pipeline,
  ``processor(text=[...], images=[...], padding=True, return_tensors="pt")``: the image processor's patches and
  grid, each ``<|image_pad|>`` expanded to the image's token count, the tokenizer. Why not ``Qwen2VLProcessor``
  itself: in transformers 5.x it cannot be constructed without torchvision (it requires a video processor), and
  torchvision has no CPU build matching this torch (an installed CUDA build breaks transformers' image
  processors). Its parts, the tokenizer and ``Qwen2VLImageProcessorPil``, load fine and are used as they are.
- ``QwenImageEditTextEncoder(dir)``: ``token_count(text, width, height)`` (the templated prompt's length with the
  image's tokens: the grouping key for batching) and ``encode([(text, image), ...]) -> [Tensor[L_i, D]]``:
  diffusers' own ``encode_prompt`` of the edit pipeline, on prompts of equal token length (no padding enters the
  encoder, so each row equals a batch of one).
- ``QwenImageConditionEncoder(dir)``: ``encode([(pixels, seed), ...]) -> [Tensor[S_c, C]]``: uint8 [H, W, 3]
  images of one size (the input image already resized to the conditioning size) to packed, normalized latents,
  as the pipelines' ``prepare_latents`` compute their ``image_latents`` (diffusers' ``preprocess``,
  ``_encode_vae_image`` and ``_pack_latents``). ``seed`` None: the edit pipeline's (the latent distribution's
  mode); a seed: the inpainting pipeline's, which samples the distribution with the request's generator (and
  normalizes by the reciprocal of the std).
- ``inpaint_noise(denoiser, n, height, width, seed)``: the inpainting pipeline's initial noise, drawn from the
  request's generator after that sample. ``pack_inpaint_mask(mask, n, vae_scale_factor, channels)``: a binarized
  mask at the conditioning size to the packed mask the inpainting pipeline (``prepare_mask_latents``) blends with.

As for Qwen-Image, the pipeline object is built from only the components a stage holds (the others ``None``), so
the prompt template, image preprocessing and packing are diffusers' code.
"""

from __future__ import annotations

import os

import torch
from PIL import Image

from omni_serve.models.qwen_image_layout import VAE_SUBFOLDER

PROCESSOR_SUBFOLDER = "processor"


def _partial_pipeline(inpaint: bool = False, **components):
    """A ``QwenImageEditPipeline`` (or ``QwenImageEditInpaintPipeline``) holding only ``components``."""
    from diffusers import QwenImageEditInpaintPipeline, QwenImageEditPipeline

    parts = {"scheduler": None, "vae": None, "text_encoder": None, "tokenizer": None, "processor": None,
             "transformer": None}
    parts.update(components)
    return (QwenImageEditInpaintPipeline if inpaint else QwenImageEditPipeline)(**parts)


class EditPromptProcessor:
    def __init__(self, tokenizer, image_processor):
        self.tokenizer, self.image_processor = tokenizer, image_processor
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str) -> "EditPromptProcessor":
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        path = os.path.join(checkpoint_dir, PROCESSOR_SUBFOLDER)
        return cls(AutoTokenizer.from_pretrained(path), Qwen2VLImageProcessorPil.from_pretrained(path))

    def image_tokens(self, width: int, height: int) -> int:
        """Tokens one image of this size becomes (its patches, merged)."""
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return patches // self.image_processor.merge_size ** 2

    def __call__(self, text, images=None, padding=True, return_tensors="pt", **kwargs):
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        out = {}
        if images is not None:
            images = images if isinstance(images, (list, tuple)) else [images]
            pixels = self.image_processor(images=list(images), return_tensors=return_tensors)
            out.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
            counts = iter(int(g.prod()) // self.image_processor.merge_size ** 2 for g in pixels["image_grid_thw"])
            expanded = []
            for t in texts:
                pieces = t.split(self.image_token)
                expanded.append(pieces[0] + "".join(self.image_token * next(counts) + p for p in pieces[1:]))
            texts = expanded
        tokens = self.tokenizer(texts, padding=padding, return_tensors=return_tensors)
        out.update(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        return BatchFeature(out)


class QwenImageEditTextEncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from transformers import Qwen2_5_VLForConditionalGeneration

        self.device = torch.device(device)
        self.processor = EditPromptProcessor.from_pretrained(checkpoint_dir)
        encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            os.path.join(checkpoint_dir, "text_encoder"), dtype=dtype).to(self.device).eval()
        self.pipe = _partial_pipeline(text_encoder=encoder, tokenizer=self.processor.tokenizer,
                                      processor=self.processor)
        self.modules = {"text_encoder": encoder}

    def token_count(self, text: str, width: int, height: int) -> int:
        """Tokens of the templated prompt with one image of this size (before the template's prefix is dropped);
        prompts with equal counts are encoded together without padding."""
        ids = self.processor.tokenizer(self.pipe.prompt_template_encode.format(text)).input_ids
        return len(ids) - 1 + self.processor.image_tokens(width, height)

    def encode(self, items: list[tuple[str, Image.Image]]) -> list[torch.Tensor]:
        texts, images = [t for t, _ in items], [i for _, i in items]
        embeds, mask = self.pipe.encode_prompt(texts, image=images, device=self.device)
        if mask is not None:  # only when lengths differ; callers group by token_count
            return [e[m.bool()] for e, m in zip(embeds, mask)]
        return list(embeds)


class QwenImageConditionEncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from diffusers import AutoencoderKLQwenImage

        self.device = torch.device(device)
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            checkpoint_dir, subfolder=VAE_SUBFOLDER, torch_dtype=dtype).to(self.device).eval()
        self.pipe = _partial_pipeline(vae=self.vae)
        self.inpaint_pipe = _partial_pipeline(inpaint=True, vae=self.vae)
        self.modules = {"vae": self.vae}

    def encode(self, items: list[tuple[torch.Tensor, int | None]]) -> list[torch.Tensor]:
        """(uint8 [H, W, 3] image, seed or None) pairs, images of one size and all seeds None or all set ->
        packed conditioning latents [S_c, C] each."""
        height, width = items[0][0].shape[:2]
        pil = [Image.fromarray(pixels.numpy()) for pixels, _ in items]
        x = torch.cat([self.pipe.image_processor.preprocess(p, height, width) for p in pil]).unsqueeze(2)
        x = x.to(self.device, self.vae.dtype)
        if items[0][1] is None:
            latents = self.pipe._encode_vae_image(x, generator=None)
        else:  # one generator per image: diffusers encodes (and samples) them one by one
            generators = [torch.Generator(device="cpu").manual_seed(seed) for _, seed in items]
            latents = self.inpaint_pipe._encode_vae_image(x, generator=generators)
        n, channels, _, h, w = latents.shape
        return list(self.pipe._pack_latents(latents, n, channels, h, w))


def inpaint_noise(denoiser, n: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Packed noise [n, S, 4C] of the inpainting pipeline: drawn from ``Generator().manual_seed(seed)`` after the
    generator sampled the input image's latent distribution ([1, C, 1, h, w] normals, ``QwenImageConditionEncoder``
    does that sample in its own stage, so here the same draw is only skipped)."""
    from diffusers import QwenImagePipeline
    from diffusers.utils.torch_utils import randn_tensor

    gh, gw = denoiser.latent_grid(height, width)
    c = denoiser.num_channels_latents
    generator = torch.Generator(device="cpu").manual_seed(seed)
    randn_tensor((1, c, 1, 2 * gh, 2 * gw), generator=generator, device=denoiser.device, dtype=denoiser.dtype)
    noise = randn_tensor((n, 1, c, 2 * gh, 2 * gw), generator=generator, device=denoiser.device, dtype=denoiser.dtype)
    return QwenImagePipeline._pack_latents(noise, n, c, 2 * gh, 2 * gw)


def pack_inpaint_mask(mask: torch.Tensor, n: int, vae_scale_factor: int, channels: int) -> torch.Tensor:
    """uint8 [H, W] mask (1: repaint) -> packed [n, S, 4 * channels], as ``prepare_mask_latents`` makes it: resized
    (nearest) to the latent grid, repeated per image and channel, packed into 2x2 patches."""
    from diffusers import QwenImagePipeline

    height = 2 * (mask.shape[0] // (vae_scale_factor * 2))
    width = 2 * (mask.shape[1] // (vae_scale_factor * 2))
    m = torch.nn.functional.interpolate(mask.to(torch.float32)[None, None], size=(height, width))
    m = m.repeat(n, 1, 1, 1).repeat(1, channels, 1, 1)
    return QwenImagePipeline._pack_latents(m, n, channels, height, width)
