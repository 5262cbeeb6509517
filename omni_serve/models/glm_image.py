"""Adapters over GLM-Image's components; each stage loads only its own part of the checkpoint (diffusers layout,
as ``GlmImagePipeline.from_pretrained`` reads it).

Contract:

- ``GlmImageAR(dir)``: the autoregressive model's text decoder and visual-token head (transformers'
  ``GlmImageTextModel`` and ``lm_head`` of ``GlmImageForConditionalGeneration``), an ``ARModel`` for
  ``omni_serve.engines.ar.AREngine``. ``prompt(text, height, width) -> ARPrompt``: the pipeline's prompt (its
  processor's chat template and target grids) with the positions ``generate`` feeds the decoder, prompt and
  generated rows, from transformers' own ``get_rope_index``; ``sampling(seed)``: the checkpoint's generation
  config as ``SamplingParams`` (the pipeline always samples: ``do_sample=True``, torch seeded with the seed).
  ``prior_tokens(prompt, generated)``: the DiT's prior token ids, the target grid's tokens upsampled 2x (the
  pipeline's own helpers).
- ``GlmImageGlyphEncoder(dir)``: ``encode(prompt) -> [L, D]``, the glyph embeddings of the prompt's quoted text
  (the pipeline's ``_get_glyph_embeds``; the negative prompt is ``""``); ``token_count(prompt)``, the batching key.
- ``GlmImageDenoiser(dir)``: ``initial_latents(n, h, w, seed)`` (the pipeline's ``prepare_latents`` with
  ``Generator().manual_seed(seed)``), ``new_scheduler(num_steps, h, w)`` (its timesteps, sigmas and shift),
  ``predict(rows, h, w)``: ONE transformer forward over rows of any requests with the same latent size and glyph
  length (the transformer's text mask is additive, not a mask, so rows are never padded); a row is a request's
  conditional or unconditional (prior tokens dropped, glyphs of ``""``) branch at its own timestep.
- ``GlmImageDecoder(dir)``: ``decode(latents [n, C, h, w], height, width) -> uint8 [n, H, W, 3]`` (the pipeline's
  de-normalisation, ``vae.decode`` and post-processing), batched over same-size images.

Image-conditioned generation is not offered: diffusers 0.42.1's pipeline fails on it with transformers 5.23
(``generate_prior_tokens`` concatenates the per-image ``pooler_output`` list that ``get_image_tokens`` iterates),
so there is no reference to check it against.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from omni_serve.engines.sampling import SamplingParams
from omni_serve.models.glm_image_layout import AR_SUBFOLDER, vae_scale_factor
from omni_serve.models.loading import load_component, read_state_dict
from omni_serve.models.paged_decoder import PagedDecoder


def _pipeline_class():
    from diffusers import GlmImagePipeline

    return GlmImagePipeline


def _partial_pipeline(**components):
    """A ``GlmImagePipeline`` holding only ``components`` (the rest None): its helpers work on those."""
    parts = dict.fromkeys(("tokenizer", "processor", "text_encoder", "vision_language_encoder", "vae", "transformer",
                           "scheduler"))
    parts.update(components)
    return _pipeline_class()(**parts)


# -- AR ------------------------------------------------------------------------------------------------------
@dataclass
class ARPrompt:
    """One request's AR input: prompt token ids and positions, and what it generates."""

    input_ids: list[int]
    positions: torch.Tensor  # [3, L] (temporal, height, width rows; plain text positions in all three)
    decode_positions: torch.Tensor  # [3, D]: the position of the j-th generated token's row, D >= num_tokens
    num_tokens: int  # visual tokens to generate: the preview grid's, then the target grid's
    target_offset: int  # where the target grid's tokens start among the generated ones
    target_grid: tuple[int, int]  # (rows, cols) of the target grid


class GlmImageAR(PagedDecoder):
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from transformers import AutoProcessor, GenerationConfig, GlmImageConfig
        from transformers.models.glm_image.modeling_glm_image import GlmImageTextModel

        path = os.path.join(checkpoint_dir, AR_SUBFOLDER)
        self.config = GlmImageConfig.from_pretrained(path)
        text = self.config.text_config
        self.model = load_component(path, GlmImageTextModel, text, {"model.language_model.": ""}, dtype, device)
        self.use_paged_attention(self.model.config, dtype, device)
        self.lm_head = torch.nn.Linear(text.hidden_size, text.vision_vocab_size, bias=False)
        self.lm_head.load_state_dict(read_state_dict(path, {"lm_head.": ""}))
        self.lm_head.to(device=device, dtype=dtype).eval()
        self.processor = AutoProcessor.from_pretrained(os.path.join(checkpoint_dir, "processor"))
        self.generation_config = GenerationConfig.from_pretrained(path)
        self.modules = {"model": self.model, "lm_head": self.lm_head}
        self.row_size = text.hidden_size  # an input row is the token's embedding
        self.position_rows = 3

    def prompt(self, text: str, height: int, width: int) -> ARPrompt:
        """The pipeline's text-to-image prompt for a ``height`` x ``width`` image (``generate_prior_tokens``)."""
        from transformers.models.glm_image.modeling_glm_image import GlmImageModel

        messages = [[{"role": "user", "content": [{"type": "text", "text": text}]}]]
        inputs = self.processor.apply_chat_template(
            messages, tokenize=True, processor_kwargs={"target_h": height, "target_w": width}, return_dict=True,
            return_tensors="pt")
        grids = inputs["image_grid_thw"]
        max_new, offset, rows, cols = _pipeline_class()._compute_generation_params(grids, is_text_to_image=True)
        # transformers' position index, on a stand-in holding only what it reads (the config) and what it leaves
        # behind (the decode positions it caches for generate)
        index = SimpleNamespace(config=self.config)
        index.get_vision_position_ids = GlmImageModel.get_vision_position_ids.__get__(index)
        positions, _ = GlmImageModel.get_rope_index(index, inputs["input_ids"], image_grid_thw=grids,
                                                    images_per_sample=inputs.get("images_per_sample"))
        # generate's last token (max_new) only closes the image; nothing reads it, so it is not generated
        return ARPrompt(input_ids=inputs["input_ids"][0].tolist(), positions=positions[:, 0],
                        decode_positions=index._cached_decode_position_ids[0], num_tokens=max_new - 1,
                        target_offset=offset, target_grid=(rows, cols))

    def sampling(self, seed: int) -> SamplingParams:
        """The checkpoint's generation config as the engine's sampling parameters (always sampled)."""
        g = self.generation_config
        return SamplingParams(temperature=g.temperature if g.temperature is not None else 1.0,
                              top_p=g.top_p if g.top_p is not None else 1.0, top_k=g.top_k or 0,
                              repetition_penalty=g.repetition_penalty or 1.0, seed=seed)

    @staticmethod
    def prior_tokens(prompt: ARPrompt, generated: list[int]) -> torch.Tensor:
        """The DiT's prior token ids ``[4 * rows * cols]``: the target grid's tokens, upsampled 2x."""
        rows, cols = prompt.target_grid
        start = prompt.target_offset
        target = torch.tensor(generated[start:start + rows * cols], dtype=torch.long)
        return _pipeline_class()._upsample_token_ids(target, rows, cols)[0]

    @torch.inference_mode()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids.to(self.device))

    @torch.inference_mode()
    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        hidden = self.run(self.model, embeds, positions, batch)
        logits = self.lm_head(hidden[logit_rows.to(hidden.device)]).float()
        return (hidden if want_hidden else None), logits


# -- glyph encoder -------------------------------------------------------------------------------------------
class GlmImageGlyphEncoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from transformers import AutoTokenizer, T5EncoderModel

        self.device, self.dtype = torch.device(device), dtype
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(checkpoint_dir, "tokenizer"))
        encoder = T5EncoderModel.from_pretrained(os.path.join(checkpoint_dir, "text_encoder"), dtype=dtype)
        self.pipe = _partial_pipeline(tokenizer=tokenizer, text_encoder=encoder.to(self.device).eval())
        self.modules = {"text_encoder": encoder}

    def token_count(self, prompt: str) -> int:
        """Glyph tokens of ``prompt`` (its embeddings' length): prompts with equal counts share a forward."""
        texts = self.pipe.get_glyph_texts(prompt)[0] or [""]
        ids = self.pipe.tokenizer(texts).input_ids
        return sum(len(i) for i in ids) + (len(ids) + 1) % 2 * len(ids)

    @torch.inference_mode()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """Each prompt's glyph embeddings ``[L, D]``, as the pipeline computes them for a batch of one."""
        return [self.pipe._get_glyph_embeds([p], device=self.device, dtype=self.dtype)[0] for p in prompts]


# -- DiT -----------------------------------------------------------------------------------------------------
@dataclass
class GlmDenoiseRow:
    """One transformer input row: latents ``[C, h, w]`` at the scheduler's timestep ``t``, glyph embeddings
    ``[L, D]``, the request's prior tokens ``[h * w / 4]`` and whether they are dropped (the CFG branch)."""

    latents: torch.Tensor
    timestep: torch.Tensor
    glyphs: torch.Tensor
    prior_tokens: torch.Tensor
    drop_prior: bool


class GlmImageDenoiser:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from diffusers import FlowMatchEulerDiscreteScheduler, GlmImageTransformer2DModel

        self.device, self.dtype = torch.device(device), dtype
        self.transformer = GlmImageTransformer2DModel.from_pretrained(
            checkpoint_dir, subfolder="transformer", torch_dtype=dtype).to(self.device).eval()
        self.scheduler_config = FlowMatchEulerDiscreteScheduler.load_config(checkpoint_dir, subfolder="scheduler")
        self.vae_scale_factor = vae_scale_factor(checkpoint_dir)
        self.channels = self.transformer.config.in_channels
        self.modules = {"transformer": self.transformer}

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def initial_latents(self, n: int, height: int, width: int, seed: int) -> torch.Tensor:
        """Noise ``[n, C, h, w]``: the pipeline's ``prepare_latents`` with ``Generator().manual_seed(seed)``."""
        from diffusers.utils.torch_utils import randn_tensor

        gen = torch.Generator(device="cpu").manual_seed(seed)
        return randn_tensor((n, self.channels, *self.latent_size(height, width)), generator=gen, device=self.device,
                            dtype=self.dtype)

    def new_scheduler(self, num_steps: int, height: int, width: int):
        """A scheduler for one request with the pipeline's timesteps, sigmas and resolution-dependent shift."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.glm_image.pipeline_glm_image import calculate_shift, retrieve_timesteps

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        cfg = scheduler.config
        h, w = self.latent_size(height, width)
        image_seq_len = h * w // self.transformer.config.patch_size ** 2
        timesteps = np.linspace(cfg.num_train_timesteps, 1.0, num_steps + 1)[:-1].astype(np.int64).astype(np.float32)
        mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256), cfg.get("base_shift", 0.25),
                             cfg.get("max_shift", 0.75))
        retrieve_timesteps(scheduler, num_steps, self.device, timesteps, timesteps / cfg.num_train_timesteps, mu=mu)
        scheduler.set_begin_index(0)
        return scheduler

    @torch.inference_mode()
    def predict(self, rows: list[GlmDenoiseRow], height: int, width: int) -> torch.Tensor:
        """One forward over ``rows`` (same latent size and glyph length); returns predictions ``[B, C, h, w]``
        (float32, as the pipeline casts them)."""
        n = len(rows)
        prior = torch.stack([r.prior_tokens for r in rows]).to(self.device)
        drop = torch.tensor([r.drop_prior for r in rows], device=self.device).view(n, 1).expand_as(prior)
        out = self.transformer(
            hidden_states=torch.stack([r.latents for r in rows]).to(self.dtype),
            encoder_hidden_states=torch.stack([r.glyphs for r in rows]).to(self.dtype),
            prior_token_id=prior, prior_token_drop=drop,
            timestep=torch.stack([r.timestep for r in rows]).to(self.device) - 1,
            target_size=torch.tensor([[height, width]] * n, dtype=self.dtype, device=self.device),
            crop_coords=torch.zeros(n, 2, dtype=self.dtype, device=self.device),
            return_dict=False)[0]
        return out.float()


def combine_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """The pipeline's classifier-free guidance (no rescaling)."""
    return uncond + scale * (cond - uncond)


# -- VAE -----------------------------------------------------------------------------------------------------
class GlmImageDecoder:
    def __init__(self, checkpoint_dir: str, dtype=torch.float32, device: str = "cpu"):
        from diffusers import AutoencoderKL

        self.device = torch.device(device)
        self.vae = AutoencoderKL.from_pretrained(checkpoint_dir, subfolder="vae", torch_dtype=dtype).to(self.device).eval()
        self.pipe = _partial_pipeline(vae=self.vae)
        cfg = self.vae.config
        shape = (1, cfg.latent_channels, 1, 1)
        self.latents_mean = torch.tensor(cfg.latents_mean).view(shape).to(self.device, self.vae.dtype)
        self.latents_std = torch.tensor(cfg.latents_std).view(shape).to(self.device, self.vae.dtype)
        self.modules = {"vae": self.vae}

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> np.ndarray:
        """Latents ``[n, C, h, w]`` of ``height`` x ``width`` images -> uint8 RGB ``[n, H, W, 3]`` (diffusers'
        ``postprocess``)."""
        f = self.pipe.vae_scale_factor
        if tuple(latents.shape[2:]) != (height // f, width // f):
            raise ValueError(f"latents {tuple(latents.shape)} are not those of a {width}x{height} image")
        x = latents.to(self.device, self.vae.dtype) * self.latents_std + self.latents_mean
        image = self.vae.decode(x, return_dict=False)[0]
        pixels = self.pipe.image_processor.postprocess(image, output_type="np")
        return (pixels * 255).round().astype(np.uint8)
