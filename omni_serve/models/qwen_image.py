"""Adapters over diffusers' Qwen-Image components; each stage loads only its own part of the checkpoint.

Contract (a checkpoint directory in the diffusers layout, as ``QwenImagePipeline.from_pretrained`` reads):

- ``QwenImageTextEncoder(dir)``: ``token_count(text)`` (the templated prompt's length, the grouping key
  for batching) and ``encode(texts) -> list[Tensor[L_i, D]]``: diffusers' own ``encode_prompt``, called on
  texts of equal token length so no padding enters the encoder (each row equals a batch of one).
- ``QwenImageDenoiser(dir, packed_linear=False, packed_forward=True)``: the transformer plus the latent geometry.
  ``initial_latents(n, h, w, seed)`` draws the packed noise exactly as the pipeline does with
  ``torch.Generator().manual_seed(seed)``; ``new_scheduler(num_steps, image_seq_len)`` returns a per-request
  ``FlowMatchEulerDiscreteScheduler`` with the pipeline's sigmas and shift; ``predict(rows)`` runs ONE transformer
  forward over rows of any requests with the same latent shape and returns one prediction each (each equal to
  the row's forward alone, to float rounding); rows may carry conditioning image latents (image-conditioned
  pipelines). Rows of different text lengths are packed without padding (``qwen_image_packed.PackedForward``,
  which also runs the row-batched DBCache, ``row_cache``) where that covers the transformer and
  ``packed_forward`` is on, else diffusers' forward pads and masks them. ``packed_linear``: the transformer's
  linear layers on weights prepacked for oneDNN (``omni_kernels.pack_linears``; docs/prepared.md has the gain).
  ``shard_sequence()`` (in a process group) makes the packed forward one rank of a sequence-parallel group.
- ``QwenImageDecoder(dir)``: ``decode(latents, height, width) -> uint8 [n, H, W, 3]`` (the pipeline's
  unpack, de-normalisation, ``vae.decode`` and post-processing), batched over same-size images; tiled
  decoding for large images via diffusers' ``enable_tiling``.

The pipeline object itself is built from only the components a stage holds (the others ``None``), so the
prompt template, packing and post-processing are diffusers' code, not copies.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from omni_serve.models.diffusion_rows import DenoiseRow
from omni_serve.models.prepared_paths import use_prepared
from omni_serve.models.qwen_image_layout import TOKENIZER_SUBFOLDER, TRANSFORMER_SUBFOLDER, VAE_SUBFOLDER, vae_scale_factor


def _partial_pipeline(**components):
    """A ``QwenImagePipeline`` holding only ``components`` (the rest None): its helpers work on those."""
    from diffusers import QwenImagePipeline

    parts = {"scheduler": None, "vae": None, "text_encoder": None, "tokenizer": None, "transformer": None}
    parts.update(components)
    return QwenImagePipeline(**parts)


class QwenImageTextEncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        self.device = torch.device(device)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint_dir, TOKENIZER_SUBFOLDER))
        encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            os.path.join(checkpoint_dir, "text_encoder"), dtype=dtype).to(self.device).eval()
        self.pipe = _partial_pipeline(text_encoder=encoder, tokenizer=tokenizer)
        self.modules = {"text_encoder": encoder}

    @property
    def max_tokens(self) -> int:
        return self.pipe.tokenizer_max_length

    def token_count(self, text: str) -> int:
        """Tokens of the templated prompt (the template's first ``prompt_template_encode_start_idx`` are dropped
        after encoding); prompts with equal counts are encoded together without padding."""
        return len(self.pipe.tokenizer(self.pipe.prompt_template_encode.format(text)).input_ids)

    def encode(self, texts: list[str]) -> list[torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(texts, device=self.device)
        if mask is not None:  # only when lengths differ; callers group by token_count
            return [e[m.bool()] for e, m in zip(embeds, mask)]
        return list(embeds)


class QwenImageDenoiser:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu", packed_linear: bool = False,
                 packed_forward: bool = True):
        from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

        from omni_serve.models.qwen_image_packed import PackedForward, supports

        self.device = torch.device(device)
        self.dtype = dtype
        self.transformer = QwenImageTransformer2DModel.from_pretrained(
            checkpoint_dir, subfolder=TRANSFORMER_SUBFOLDER, torch_dtype=dtype).to(self.device).eval()
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(checkpoint_dir, subfolder="scheduler")
        self.vae_scale_factor = vae_scale_factor(checkpoint_dir)
        self.num_channels_latents = self.transformer.config.in_channels // 4
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.modules = {"transformer": self.transformer}
        # The uncached forward; cache acceleration patches ``transformer.forward`` and points this at the
        # original (see ``omni_serve.kits.diffusion.replica.cache``).
        self.plain_forward = self.transformer
        self.packed = None
        if use_prepared("qwen_image.transformer", packed_forward, packed_forward and supports(self.transformer),
                        "params.packed_forward", "a transformer variant the packed forward does not cover", "packed"):
            self.packed = PackedForward(self.transformer)
        if packed_linear:
            from omni_kernels import pack_linears

            pack_linears(self.transformer, batch_hint=1024)

    def check_sequence_split(self) -> None:
        """Raises ``ValueError`` unless ``shard_sequence`` can run (it needs the packed forward)."""
        if self.packed is None:
            raise ValueError("parallel.sequence needs the packed forward (params.packed_forward, and a transformer "
                             "variant it covers)")

    def shard_sequence(self) -> None:
        """Make this denoiser one rank of a sequence-parallel group (the process group this process joined): its
        packed forward keeps this rank's share of the image tokens (``omni_serve.parallel.sequence``)."""
        from omni_serve.parallel.sequence import SequenceShards

        self.check_sequence_split()
        self.packed.shards = SequenceShards()

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of 2x2 latent patches: the transformer's image token grid."""
        f = self.vae_scale_factor * 2
        return height // f, width // f

    def initial_latents(self, n: int, height: int, width: int, seed: int) -> torch.Tensor:
        """Packed noise [n, S, 4C]: the pipeline's ``prepare_latents`` with ``Generator().manual_seed(seed)``."""
        from diffusers import QwenImagePipeline
        from diffusers.utils.torch_utils import randn_tensor

        gh, gw = self.latent_grid(height, width)
        c = self.num_channels_latents
        gen = torch.Generator(device="cpu").manual_seed(seed)
        noise = randn_tensor((n, 1, c, 2 * gh, 2 * gw), generator=gen, device=self.device, dtype=self.dtype)
        return QwenImagePipeline._pack_latents(noise, n, c, 2 * gh, 2 * gw)

    def new_scheduler(self, num_steps: int, image_seq_len: int):
        """A scheduler for one request, with the pipeline's sigmas and resolution-dependent shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        cfg = scheduler.config
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        retrieve_timesteps(scheduler, num_steps, self.device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    def prepare(self, request) -> tuple[tuple[int, int], torch.Tensor, object]:
        """A request's (latent grid, initial latents, scheduler): what the diffusion kit's ``DenoiseProgram`` asks
        of any denoiser (``request``: the kit's ``DenoiseCall``)."""
        latents = self.initial_latents(request.n, request.height, request.width, request.seed)
        return (self.latent_grid(request.height, request.width), latents,
                self.new_scheduler(request.num_steps, latents.shape[1]))

    @staticmethod
    def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        return combine_cfg(cond, uncond, scale)

    def predict(self, rows: list[DenoiseRow], grid: tuple[int, int], forward=None,
                condition_grid: tuple[int, int] | None = None, row_cache=None) -> torch.Tensor:
        """One forward over ``rows`` (all on the same latent ``grid``); returns predictions [B, S, 4C].
        ``forward``: a transformer forward to run in diffusers' padded form (cache-dit's patched one); by default
        the packed forward when it covers the transformer (with ``row_cache``: DBCache decisions per row group),
        else the plain one. With ``condition_grid``, every row's ``condition`` latents follow its noised latents in
        the transformer's sequence (a second image segment of ``img_shapes``, as diffusers' edit pipelines pass
        them) and the prediction is that of the noised latents only."""
        shapes = [(1, *grid)] + ([(1, *condition_grid)] if condition_grid is not None else [])
        if forward is None and self.packed is not None:
            latents = torch.stack([r.latents for r in rows])
            if condition_grid is not None:
                latents = torch.cat([latents, torch.stack([r.condition for r in rows])], dim=1)
            timestep = torch.stack([r.timestep for r in rows]).to(self.dtype) / 1000
            out = self.packed(latents, [r.text for r in rows], timestep, shapes, row_cache=row_cache)
            return out if condition_grid is None else out[:, :rows[0].latents.shape[0]]
        if row_cache is not None:
            raise ValueError("row-batched caching needs the packed forward")
        lengths = [r.text.shape[0] for r in rows]
        longest = max(lengths)
        text = torch.stack([torch.nn.functional.pad(r.text, (0, 0, 0, longest - r.text.shape[0])) for r in rows])
        mask = None
        if min(lengths) != longest:  # padding present: mask it out of attention (and RoPE lengths)
            mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).to(self.device)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.tensor([r.guidance for r in rows], dtype=torch.float32, device=self.device)
        timestep = torch.stack([r.timestep for r in rows]).to(self.dtype)
        latents = torch.stack([r.latents for r in rows])
        if condition_grid is not None:
            latents = torch.cat([latents, torch.stack([r.condition for r in rows])], dim=1)
        out = (forward or self.plain_forward)(
            hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
            encoder_hidden_states=text, encoder_hidden_states_mask=mask,
            img_shapes=[shapes] * len(rows), return_dict=False)[0]
        return out if condition_grid is None else out[:, :rows[0].latents.shape[0]]


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The pipeline's true-CFG combination, norm-rescaled to the conditional prediction."""
    comb = uncond + scale * (cond - uncond)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


class QwenImageDecoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu",
                 tile_min_pixels: int | None = None, tile_stride_pixels: int | None = None):
        from diffusers import AutoencoderKLQwenImage

        self.device = torch.device(device)
        self.vae = AutoencoderKLQwenImage.from_pretrained(
            checkpoint_dir, subfolder=VAE_SUBFOLDER, torch_dtype=dtype).to(self.device).eval()
        if tile_min_pixels:
            stride = tile_stride_pixels or tile_min_pixels * 3 // 4
            self.vae.enable_tiling(tile_min_pixels, tile_min_pixels, stride, stride)
        self.pipe = _partial_pipeline(vae=self.vae)
        cfg = self.vae.config
        self.latents_mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(self.device, self.vae.dtype)
        # Stored inverted and divided by, as the pipeline does (bit-identical de-normalisation).
        self.inv_latents_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(
            self.device, self.vae.dtype)
        self.modules = {"vae": self.vae}

    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Packed latents [n, S, 4C] -> uint8 RGB images [n, H, W, 3] (diffusers' ``postprocess``)."""
        x = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor).to(self.vae.dtype)
        x = x / self.inv_latents_std + self.latents_mean
        image = self.vae.decode(x, return_dict=False)[0][:, :, 0]
        pixels = self.pipe.image_processor.postprocess(image, output_type="np")
        return (pixels * 255).round().astype(np.uint8)
