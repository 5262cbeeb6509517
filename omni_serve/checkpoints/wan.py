"""Deterministic random-weight Wan 2.1 text-to-video and image-to-video checkpoints in the diffusers on-disk layout.

Contract: ``make_checkpoint(out_dir, size, seed)`` writes model_index.json and the five component folders
(``tokenizer/``: a locally trained UMT5-style Unigram tokenizer; ``text_encoder/``: a transformers
``UMT5EncoderModel``; ``transformer/``: ``WanTransformer3DModel``; ``vae/``: ``AutoencoderKLWan``; ``scheduler/``:
``UniPCMultistepScheduler`` with the real Wan 2.1 scheduler config) plus ``omni_serve_checkpoint.json``, such that
``diffusers.WanPipeline.from_pretrained(out_dir)`` loads it as it would a real ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``
directory. The same ``size`` and ``seed`` always yield byte-identical weights (torch is seeded before each component
is built). ``make_i2v_checkpoint(out_dir, size, seed)`` writes the image-to-video layout that
``diffusers.WanImageToVideoPipeline.from_pretrained`` reads (``Wan-AI/Wan2.1-I2V-14B-480P-Diffusers``): the same
components, a transformer taking the first-frame conditioning channels (``in_channels`` 36: 16 noise, 4 mask, 16
image latents) and CLIP image tokens (``image_dim``, ``added_kv_proj_dim``), plus ``image_encoder/`` (a transformers
``CLIPVisionModel``) and ``image_processor/`` (``CLIPImageProcessor``, at the tiny encoder's resolution). Shapes follow
the real model where the pipeline depends on them: the text encoder's ``d_model`` is the
transformer's ``text_dim``; the VAE keeps 16 latent channels, Wan's latent statistics and its ``temperal_downsample``
(8x in space, 4x in time: sizes are multiples of 16, frame counts ``4k + 1``); the transformer patches (1, 2, 2).

Sizes:

- ``tiny``: ~0.1 M parameters, for tests (a 2-step, 5-frame 16x16 video takes well under a second on CPU);
- ``small``: a transformer of 4 layers (4 heads of 24) and a wider VAE, so a step is model compute on CPU
  (benchmarks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omni_serve.checkpoints import write_marker

# The real Wan2.1-T2V scheduler/scheduler_config.json values (flow_shift 3.0: the 480p setting).
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000, "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear",
    "solver_order": 2, "prediction_type": "flow_prediction", "thresholding": False, "predict_x0": True,
    "solver_type": "bh2", "lower_order_final": True, "disable_corrector": [], "use_karras_sigmas": False,
    "use_exponential_sigmas": False, "use_beta_sigmas": False, "use_flow_sigmas": True, "flow_shift": 3.0,
    "timestep_spacing": "linspace", "steps_offset": 0, "final_sigmas_type": "zero",
}
Z_DIM = 16  # the VAE's latent channels (Wan 2.1)


@dataclass(frozen=True)
class WanSize:
    vocab: int
    text_dim: int
    text_kv: int
    text_ff: int
    text_layers: int
    text_heads: int
    dit_layers: int
    dit_heads: int
    dit_head_dim: int  # RoPE splits it over (frames, height, width) as d - 4(d // 6), 2(d // 6), 2(d // 6): even parts
    dit_ffn: int
    dit_freq_dim: int
    vae_base_dim: int
    vae_dim_mult: tuple[int, ...]
    clip_dim: int = 32  # image-to-video: the CLIP vision tower's width (its tokens' size, the transformer's image_dim)
    clip_image: int = 32  # image-to-video: the CLIP resolution (224 in the real model; patches of 8 here)


SIZES = {
    "tiny": WanSize(vocab=400, text_dim=32, text_kv=8, text_ff=64, text_layers=2, text_heads=4, dit_layers=2,
                    dit_heads=2, dit_head_dim=12, dit_ffn=32, dit_freq_dim=32, vae_base_dim=8,
                    vae_dim_mult=(1, 1, 1, 1)),
    "small": WanSize(vocab=2048, text_dim=64, text_kv=16, text_ff=128, text_layers=2, text_heads=4, dit_layers=4,
                     dit_heads=4, dit_head_dim=24, dit_ffn=256, dit_freq_dim=64, vae_base_dim=16,
                     vae_dim_mult=(1, 2, 2, 2)),
}


def build_components(s: WanSize, seed: int, image_to_video: bool = False) -> dict:
    """The pipeline's components for size ``s``, each model built right after seeding torch; with
    ``image_to_video``, ``WanImageToVideoPipeline``'s."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from omni_serve.checkpoints.tokenizer import build_t5_tokenizer

    tokenizer = build_t5_tokenizer(s.vocab)
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=s.text_dim, d_kv=s.text_kv, d_ff=s.text_ff, num_layers=s.text_layers,
        num_heads=s.text_heads, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)).eval()
    torch.manual_seed(seed + 1)
    inner = s.dit_heads * s.dit_head_dim
    # image-to-video (Wan 2.1): noise, mask (the VAE's temporal compression: 4) and image latents side by side; the
    # CLIP tokens attend through their own key/value projections (added_kv_proj_dim: the inner width, as released)
    image = {"in_channels": 2 * Z_DIM + 4, "image_dim": s.clip_dim, "added_kv_proj_dim": inner} if image_to_video \
        else {"in_channels": Z_DIM}
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=s.dit_heads, attention_head_dim=s.dit_head_dim,
        out_channels=Z_DIM, text_dim=s.text_dim, freq_dim=s.dit_freq_dim, ffn_dim=s.dit_ffn,
        num_layers=s.dit_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        rope_max_seq_len=1024, **image).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKLWan(base_dim=s.vae_base_dim, z_dim=Z_DIM, dim_mult=list(s.vae_dim_mult), num_res_blocks=1,
                           attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0).eval()
    parts = {"tokenizer": tokenizer, "text_encoder": text_encoder, "transformer": transformer, "vae": vae,
             "scheduler": UniPCMultistepScheduler(**SCHEDULER_CONFIG)}
    if image_to_video:
        parts.update(_image_components(s, seed + 3))
    return parts


def _image_components(s: WanSize, seed: int) -> dict:
    """The image-to-video pipeline's CLIP vision tower (the pipeline reads its second-to-last hidden states) and its
    processor (the real one's resize, crop and normalization, at the tiny tower's resolution)."""
    import torch
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=s.clip_dim, intermediate_size=2 * s.clip_dim, num_hidden_layers=3, num_attention_heads=4,
        image_size=s.clip_image, patch_size=8, projection_dim=s.clip_dim, hidden_act="gelu")).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": s.clip_image},
                                   crop_size={"height": s.clip_image, "width": s.clip_image})
    return {"image_encoder": encoder, "image_processor": processor}


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight Wan 2.1 text-to-video checkpoint to ``out_dir``; returns the path."""
    from diffusers import WanPipeline

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    os.makedirs(out_dir, exist_ok=True)
    WanPipeline(**build_components(SIZES[size], seed)).save_pretrained(out_dir, safe_serialization=True)
    write_marker(out_dir, "wan", size, seed)
    return out_dir


def make_i2v_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight Wan 2.1 image-to-video checkpoint to ``out_dir``; returns the path."""
    from diffusers import WanImageToVideoPipeline

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    os.makedirs(out_dir, exist_ok=True)
    WanImageToVideoPipeline(**build_components(SIZES[size], seed, image_to_video=True)).save_pretrained(
        out_dir, safe_serialization=True)
    write_marker(out_dir, "wan_i2v", size, seed)
    return out_dir
