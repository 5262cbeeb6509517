"""Adapters over diffusers' Wan 2.1 text-to-video components; each stage loads only its own part of the checkpoint.
The text encoder, denoiser and decoder serve the image-to-video pipeline too (its own stages:
``omni_serve.models.wan_i2v``).

Contract (a checkpoint directory in the diffusers layout, as ``WanPipeline.from_pretrained`` reads):

- ``WanTextEncoder(dir)``: ``token_count(text)`` (the cleaned prompt's UMT5 tokens, ``</s>`` included, at most
  ``max_tokens``: longer prompts are truncated as the pipeline truncates them; the grouping key for batching) and
  ``encode(texts) -> list[Tensor[L_i, D]]``: diffusers' own ``_get_t5_prompt_embeds``, called on texts of equal token
  count so no padding enters the encoder. The pipeline pads every prompt's embeddings with zeros to ``max_tokens``
  rows; ``WanDenoiser.predict`` does that, so only the real rows travel between stages.
- ``WanDenoiser(dir)``: the transformer plus the latent geometry. ``check_size(num_frames, height, width)`` refuses
  (``ValueError``) what the pipeline would round; ``latent_shape(num_frames, height, width)`` is one video's latent
  [C, F', H', W']; ``initial_latents(n, num_frames, height, width, seed)`` draws the float32 noise exactly as the
  pipeline does with ``torch.Generator().manual_seed(seed)``; ``new_scheduler(num_steps)`` returns a per-request
  ``UniPCMultistepScheduler`` (the checkpoint's config: flow prediction, its ``flow_shift``; stateful, so one per
  request); ``predict(rows)`` (``DenoiseRow``s) runs ONE transformer forward over rows of any requests with the same
  latent shape and any timesteps, and returns one prediction each (each equal to the row's forward alone, to float
  rounding; predictions in float32, so guidance is combined in float32 where the pipeline combines it in the
  transformer's dtype: equal in float32, not bit-equal in bfloat16). ``prepare(call)`` and the static
  ``combine_cfg`` make it a denoiser for the diffusion kit's ``DenoiseProgram``; ``combine_cfg`` is the pipeline's
  classifier-free guidance (plain: ``uncond + scale * (cond - uncond)``), which the pipeline applies when
  ``guidance_scale > 1`` (with an empty negative prompt when none is given).
- ``WanDecoder(dir, tile_min_pixels=None, tile_stride_pixels=None)``: ``decode(latents) -> uint8 [n, F, H, W, 3]``
  (the pipeline's de-normalisation, ``vae.decode`` and ``postprocess_video``), batched over videos of one shape;
  with ``tile_min_pixels`` diffusers' tiled decode (as ``vae.enable_tiling``) for sides above it.

The pipeline object itself is built from only the components a stage holds (the others ``None``), so prompt
cleaning, the text encoder call and post-processing are diffusers' code, not copies.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from omni_serve.models.diffusion_rows import DenoiseRow

MAX_TEXT_TOKENS = 512  # the pipeline's max_sequence_length; its attention processors take the text to be this long


def _partial_pipeline(**components):
    """A ``WanPipeline`` holding only ``components`` (the rest None): its helpers work on those."""
    from diffusers import WanPipeline

    parts = {"tokenizer": None, "text_encoder": None, "transformer": None, "vae": None, "scheduler": None}
    parts.update(components)
    return WanPipeline(**parts)


class WanTextEncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from transformers import AutoTokenizer, UMT5EncoderModel

        self.device = torch.device(device)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint_dir, "tokenizer"))
        encoder = UMT5EncoderModel.from_pretrained(os.path.join(checkpoint_dir, "text_encoder"),
                                                   dtype=dtype).to(self.device).eval()
        self.pipe = _partial_pipeline(text_encoder=encoder, tokenizer=tokenizer)
        self.modules = {"text_encoder": encoder}

    @property
    def max_tokens(self) -> int:
        return MAX_TEXT_TOKENS

    def token_count(self, text: str) -> int:
        """Tokens of the prompt as the pipeline cleans it (``</s>`` included); prompts with equal counts are
        encoded together without padding."""
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        count = len(self.pipe.tokenizer(prompt_clean(text), add_special_tokens=True).input_ids)
        return min(count, MAX_TEXT_TOKENS)  # the pipeline truncates longer prompts (keeping ``</s>``)

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> list[torch.Tensor]:
        counts = {self.token_count(t) for t in texts}
        if len(counts) != 1:
            raise ValueError(f"texts of one call must have one token count, got {sorted(counts)}")
        embeds = self.pipe._get_t5_prompt_embeds(texts, max_sequence_length=counts.pop(), device=self.device)
        return list(embeds)


class WanDenoiser:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

        self.device, self.dtype = torch.device(device), dtype
        self.transformer = WanTransformer3DModel.from_pretrained(
            checkpoint_dir, subfolder="transformer", torch_dtype=dtype).to(self.device).eval()
        self.scheduler_config = UniPCMultistepScheduler.load_config(checkpoint_dir, subfolder="scheduler")
        vae = AutoencoderKLWan.load_config(checkpoint_dir, subfolder="vae")
        self.scale_temporal = vae.get("scale_factor_temporal", 4)
        self.scale_spatial = vae.get("scale_factor_spatial", 8)
        self.channels = self.transformer.config.out_channels  # the noise's (image-to-video takes more in)
        self.modules = {"transformer": self.transformer}

    @property
    def size_multiple(self) -> int:
        """Heights and widths are multiples of this: the VAE's spatial compression times the transformer's patch."""
        return self.scale_spatial * self.transformer.config.patch_size[1]

    def check_size(self, num_frames: int, height: int, width: int) -> None:
        """A ``ValueError`` unless the pipeline would take this size and frame count as they are (it rounds others
        silently: frame counts to ``4k + 1``, sides down to a multiple of 16)."""
        m, t = self.size_multiple, self.scale_temporal
        if height % m or width % m or height < m or width < m:
            raise ValueError(f"the video's width and height must be multiples of {m}, got {width}x{height}")
        if num_frames < 1 or (num_frames - 1) % t:
            raise ValueError(f"num_frames must be {t}k + 1 (1, {t + 1}, {2 * t + 1}, ...), got {num_frames}")

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """One video's latent [C, F', H', W'] (the pipeline's ``prepare_latents``)."""
        return (self.channels, (num_frames - 1) // self.scale_temporal + 1, height // self.scale_spatial,
                width // self.scale_spatial)

    def initial_latents(self, n: int, num_frames: int, height: int, width: int, seed: int) -> torch.Tensor:
        """Noise [n, C, F', H', W'] in float32: the pipeline's ``prepare_latents`` with ``Generator().manual_seed``."""
        from diffusers.utils.torch_utils import randn_tensor

        gen = torch.Generator(device="cpu").manual_seed(seed)
        return randn_tensor((n, *self.latent_shape(num_frames, height, width)), generator=gen, device=self.device,
                            dtype=torch.float32)

    def new_scheduler(self, num_steps: int):
        from diffusers import UniPCMultistepScheduler

        scheduler = UniPCMultistepScheduler.from_config(self.scheduler_config)
        scheduler.set_timesteps(num_steps, device=self.device)
        scheduler.set_begin_index(0)
        return scheduler

    def prepare(self, request) -> tuple[tuple[int, ...], torch.Tensor, object]:
        """A request's (latent shape, initial latents, scheduler), as the diffusion kit's ``DenoiseProgram`` asks
        (``request``: a denoise call with ``num_frames``)."""
        r = request
        self.check_size(r.num_frames, r.height, r.width)
        return (self.latent_shape(r.num_frames, r.height, r.width),
                self.initial_latents(r.n, r.num_frames, r.height, r.width, r.seed), self.new_scheduler(r.num_steps))

    @staticmethod
    def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        return combine_cfg(cond, uncond, scale)

    packed = None  # no packed forward: cached requests run alone, through cache-dit's patched forward

    @property
    def image_to_video(self) -> bool:
        """An image-to-video transformer (Wan 2.1's): every row carries first-frame latents and CLIP tokens."""
        return self.transformer.config.image_dim is not None

    @torch.inference_mode()
    def predict(self, rows: list[DenoiseRow], grid=None, condition_grid=None, row_cache=None) -> torch.Tensor:
        """One forward over ``rows`` (one latent shape, any timesteps); predictions [B, C, F', H', W'] in float32.
        Each row's text is zero-padded to ``MAX_TEXT_TOKENS`` rows, as the pipeline's prompt embeddings are. On an
        image-to-video transformer each row's ``condition`` (mask and first-frame latents) is stacked after its
        noise on the channels and its ``image`` tokens go in beside the text, as the pipeline's loop does."""
        if condition_grid is not None or row_cache is not None:
            raise ValueError("Wan rows carry no packed conditioning and no row cache")
        i2v = self.image_to_video
        if any((r.condition is None) == i2v or (r.image is None) == i2v for r in rows):
            raise ValueError("an image-to-video transformer needs every row's first-frame latents and image tokens; "
                             "a text-to-video one takes neither")
        if max(r.text.shape[0] for r in rows) > MAX_TEXT_TOKENS:
            raise ValueError(f"a prompt's embeddings are longer than {MAX_TEXT_TOKENS} rows")
        text = torch.stack([torch.nn.functional.pad(r.text, (0, 0, 0, MAX_TEXT_TOKENS - r.text.shape[0]))
                            for r in rows]).to(self.device, self.dtype)
        latents = torch.stack([r.latents if r.condition is None else torch.cat([r.latents, r.condition.to(
            r.latents.dtype)]) for r in rows]).to(self.dtype)
        image = torch.stack([r.image for r in rows]).to(self.device, self.dtype) if i2v else None
        timestep = torch.stack([r.timestep for r in rows]).to(self.device)
        out = self.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                               encoder_hidden_states_image=image, return_dict=False)[0]
        return out.float()


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The pipeline's classifier-free guidance."""
    return uncond + scale * (cond - uncond)


class WanDecoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu",
                 tile_min_pixels: int | None = None, tile_stride_pixels: int | None = None):
        from diffusers import AutoencoderKLWan

        self.device = torch.device(device)
        self.vae = AutoencoderKLWan.from_pretrained(checkpoint_dir, subfolder="vae",
                                                    torch_dtype=dtype).to(self.device).eval()
        if tile_min_pixels:  # diffusers' tiled decode: sides above the tile in overlapping tiles, blended
            stride = tile_stride_pixels or tile_min_pixels * 3 // 4
            self.vae.enable_tiling(tile_min_pixels, tile_min_pixels, stride, stride)
        self.pipe = _partial_pipeline(vae=self.vae)
        cfg = self.vae.config
        self.latents_mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(self.device, self.vae.dtype)
        # Stored inverted and divided by, as the pipeline does (bit-identical de-normalisation).
        self.inv_latents_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(
            self.device, self.vae.dtype)
        self.modules = {"vae": self.vae}

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, height: int | None = None, width: int | None = None) -> np.ndarray:
        """Latents [n, C, F', H', W'] -> uint8 RGB frames [n, F, H, W, 3] (diffusers' ``postprocess_video``); the
        size is the latents' (``height`` and ``width``, the kit's decode call's, are not needed)."""
        x = latents.to(self.device, self.vae.dtype) / self.inv_latents_std + self.latents_mean
        video = self.vae.decode(x, return_dict=False)[0]
        frames = self.pipe.video_processor.postprocess_video(video, output_type="np")
        return (frames * 255).round().astype(np.uint8)
