"""Deterministic random-weight Qwen-Image checkpoints in the diffusers on-disk layout.

Contract: ``make_checkpoint(out_dir, size, seed)`` writes model_index.json and the five component folders
(``text_encoder/``: a transformers ``Qwen2_5_VLForConditionalGeneration`` with a minimal vision tower;
``tokenizer/``: a locally trained Qwen2 BPE tokenizer; ``transformer/``: ``QwenImageTransformer2DModel``;
``vae/``: ``AutoencoderKLQwenImage``; ``scheduler/``: ``FlowMatchEulerDiscreteScheduler`` with the real
Qwen-Image scheduler config) plus ``omni_serve_checkpoint.json``, such that
``diffusers.QwenImagePipeline.from_pretrained(out_dir)`` loads it as it would a real ``Qwen/Qwen-Image``
directory. The same ``size`` and ``seed`` always yield byte-identical weights (torch is seeded before each
component is built). Shapes are consistent the way the pipeline needs them: text hidden size equals the
transformer's ``joint_attention_dim``; the VAE's ``z_dim`` equals ``in_channels // 4`` and ``out_channels``;
the VAE keeps the real 3-entry ``temperal_downsample`` (vae_scale_factor 8, so sizes are multiples of 16).

Note: the pipeline drops the first ``prompt_template_encode_start_idx = 34`` tokens of its prompt template
(the system prefix, 34 tokens with the real tokenizer). Our tokenizer is trained with that template in its
corpus, so the prefix is exactly 34 tokens here too (``template_prefix_tokens``) and only the user's prompt
and the assistant header reach the transformer, as with the real model. Sizes:

- ``tiny``: ~3 M parameters in all (mostly VAE), for tests (a 2-step 64x64 call takes ~0.1 s on CPU);
- ``small``: a ~27 M-parameter transformer (4 M text encoder, 10 M VAE), so a denoising step is dominated by
  model compute on CPU (used by benchmarks).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from omni_serve.checkpoints import write_marker

log = logging.getLogger(__name__)

# Special tokens in id order (id = index). Names follow the real Qwen2.5-VL tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
TOKEN_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}

# Text-only chat template (the pipeline formats its own prompt template; this is for completeness).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The real Qwen-Image scheduler/scheduler_config.json values.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "invert_sigmas": False,
    "shift_terminal": 0.02, "use_karras_sigmas": False, "use_exponential_sigmas": False,
    "use_beta_sigmas": False, "time_shift_type": "exponential", "stochastic_sampling": False,
}

# The real VAE latent statistics (z_dim 16).
LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
               3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
Z_DIM = len(LATENTS_MEAN)


@dataclass(frozen=True)
class QwenImageSize:
    vocab: int
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    mrope: tuple[int, int, int]
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    dit_rope: tuple[int, int, int]
    vae_base_dim: int
    vae_res_blocks: int


SIZES = {
    "tiny": QwenImageSize(
        vocab=512, text_hidden=64, text_intermediate=128, text_layers=2, text_heads=4, text_kv_heads=2,
        mrope=(2, 3, 3), dit_layers=2, dit_heads=2, dit_head_dim=32, dit_rope=(8, 12, 12),
        vae_base_dim=16, vae_res_blocks=1,
    ),
    "small": QwenImageSize(
        vocab=2048, text_hidden=256, text_intermediate=768, text_layers=4, text_heads=4, text_kv_heads=2,
        mrope=(8, 12, 12), dit_layers=5, dit_heads=6, dit_head_dim=64, dit_rope=(16, 24, 24),
        vae_base_dim=16, vae_res_blocks=1,
    ),
}


def build_text_encoder_config(size: QwenImageSize, vocab_size: int):
    """The ``Qwen2_5_VLConfig``: tiny text model, minimal (1-block) vision tower; ids point at our tokens."""
    from transformers import Qwen2_5_VLConfig

    s = size
    assert sum(s.mrope) * 2 == s.text_hidden // s.text_heads, "mrope_section must sum to head_dim/2"
    text = {
        "vocab_size": vocab_size, "hidden_size": s.text_hidden, "intermediate_size": s.text_intermediate,
        "num_hidden_layers": s.text_layers, "num_attention_heads": s.text_heads,
        "num_key_value_heads": s.text_kv_heads, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(s.mrope)},
        "bos_token_id": TOKEN_ID["<|endoftext|>"], "eos_token_id": TOKEN_ID["<|im_end|>"],
        "pad_token_id": TOKEN_ID["<|endoftext|>"],
    }
    vision = {
        "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": s.text_hidden,
        "fullatt_block_indexes": [0], "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 112,
    }
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision,
        image_token_id=TOKEN_ID["<|image_pad|>"], video_token_id=TOKEN_ID["<|video_pad|>"],
        vision_start_token_id=TOKEN_ID["<|vision_start|>"], vision_end_token_id=TOKEN_ID["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build_tokenizer(size: QwenImageSize):
    from omni_serve.checkpoints.tokenizer import build_qwen_tokenizer

    extra_special = {
        "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
        "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
    }
    # The pipeline drops the first 34 tokens of its prompt template, which is the system prefix with the real
    # tokenizer (one token per word). Training on the template makes our prefix tokenize the same way, so
    # only the user's prompt (and the assistant header) reaches the transformer, as with the real model.
    template = _prompt_template().replace("{}", "")
    return build_qwen_tokenizer(SPECIAL_TOKENS, size.vocab, extra_special, CHAT_TEMPLATE,
                                extra_corpus=[template] * 400)


def template_prefix_tokens(tokenizer) -> int:
    """Tokens of the pipeline's prompt template up to and including ``<|im_start|>user\\n`` (34 if real)."""
    template = _prompt_template()
    prefix = template[: template.index("{}")]
    return len(tokenizer(prefix)["input_ids"])


def _prompt_template() -> str:
    # The pipeline sets this in __init__; read it off an instance built without components.
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    return pipe.prompt_template_encode


def build_components(s: QwenImageSize, tokenizer, seed: int) -> dict:
    """The pipeline's model components for size ``s`` (text encoder sized to ``tokenizer``), each built right after
    seeding torch, so the same size, tokenizer and seed always give the same weights."""
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    assert sum(s.dit_rope) == s.dit_head_dim, "axes_dims_rope must sum to attention_head_dim"
    config = build_text_encoder_config(s, vocab_size=len(tokenizer))
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()

    torch.manual_seed(seed + 1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=Z_DIM * 4, out_channels=Z_DIM, num_layers=s.dit_layers,
        attention_head_dim=s.dit_head_dim, num_attention_heads=s.dit_heads, joint_attention_dim=s.text_hidden,
        guidance_embeds=False, axes_dims_rope=s.dit_rope,
    ).eval()

    torch.manual_seed(seed + 2)
    vae = AutoencoderKLQwenImage(
        base_dim=s.vae_base_dim, z_dim=Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=s.vae_res_blocks,
        attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
        latents_mean=list(LATENTS_MEAN), latents_std=list(LATENTS_STD),
    ).eval()
    return {"scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tokenizer, "transformer": transformer}


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight Qwen-Image checkpoint to ``out_dir``; returns the path."""
    from diffusers import QwenImagePipeline

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    s = SIZES[size]
    os.makedirs(out_dir, exist_ok=True)
    QwenImagePipeline(**build_components(s, build_tokenizer(s), seed)).save_pretrained(out_dir, safe_serialization=True)
    write_marker(out_dir, "qwen_image", size, seed)
    return out_dir
