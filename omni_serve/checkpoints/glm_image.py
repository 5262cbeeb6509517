"""Deterministic random-weight GLM-Image checkpoints in the diffusers on-disk layout.

Contract: ``make_checkpoint(out_dir, size, seed)`` writes model_index.json and the seven component folders that
``diffusers.GlmImagePipeline.from_pretrained(out_dir)`` loads as it would a real ``zai-org/GLM-Image`` directory:

- ``vision_language_encoder/``: transformers' ``GlmImageForConditionalGeneration`` (the autoregressive model that
  writes the image's visual tokens; a minimal vision tower and VQ codebook for image conditioning), with a
  ``generation_config.json`` that samples (temperature, top-p), as the pipeline always calls ``generate`` with
  ``do_sample=True``;
- ``processor/``: ``GlmImageProcessor`` = a locally trained byte-level BPE tokenizer + ``GlmImageImageProcessor``
  (patch 16, no merge, mean/std 0.5: GLM-Image's values, not the class defaults);
- ``tokenizer/`` + ``text_encoder/``: ``ByT5Tokenizer`` and a ``T5EncoderModel`` (the glyph encoder for quoted text);
- ``transformer/``: ``GlmImageTransformer2DModel``; ``vae/``: ``AutoencoderKL``; ``scheduler/``:
  ``FlowMatchEulerDiscreteScheduler`` with dynamic (linear) shifting;
plus ``omni_serve_checkpoint.json``. The same ``size`` and ``seed`` always give byte-identical weights.

Shapes are tied the way the pipeline needs them:
- the AR model's visual tokens are the first ``codebook`` ids of its vocabulary (``<|dit_token_i|>`` = id i), then
  the image start (= the tokenizer's bos) and end (= eos) tokens; its lm_head covers only the ``codebook`` visual
  ids (``vision_vocab_size``), so random weights can never end an image early or emit an id the DiT's
  ``prior_token_embedding`` lacks (a real checkpoint relies on training for that);
- ``vq_config.latent_channels`` equals the vision tower's width; the vision patch is 16 with no merge, so a source
  image's token grid is its size / 32, the AR's grid factor;
- VAE downsampling 8 x DiT patch 2 = 16 = 32 / 2 (the AR grid upsampled 2x): one prior token per DiT token;
- the DiT's ``text_embed_dim`` equals the glyph encoder's ``d_model``; its channels equal the VAE's latent channels.

Sizes: ``tiny`` (well under 1 M parameters; a 64x64 image is ~0.3 s of AR on CPU) for tests, ``small`` (a ~10 M
AR model and a ~2 M DiT, so AR decoding and DiT steps are model compute on CPU) for benchmarks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omni_serve.checkpoints import write_marker
from omni_serve.checkpoints.tokenizer import _corpus
from omni_serve.models.glm_image_layout import GRID_FACTOR

# The real GLM-Image scheduler config is not public in a form we can read here; this is CogView4's (GLM-Image's
# DiT lineage): sigmas from the pipeline, linearly shifted by a resolution-dependent mu.
SCHEDULER_CONFIG = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.25,
    "max_shift": 0.75, "base_image_seq_len": 256, "max_image_seq_len": 4096, "time_shift_type": "linear",
}
LATENT_CHANNELS = 4
LOGIT_SPREAD = 3.0  # std of the AR's visual-token logits (see build_components)
ATTENTION_SHARPENING = 4.0  # the AR's query and key weights, times the default init (see build_components)


@dataclass(frozen=True)
class GlmImageSize:
    codebook: int  # visual token ids (VQ codebook, AR lm_head, DiT prior embedding)
    vocab_extra: int  # tokenizer vocabulary beyond the special tokens (bytes + merges)
    ar_hidden: int
    ar_intermediate: int
    ar_layers: int
    ar_heads: int
    ar_kv_heads: int
    mrope: tuple[int, int, int]  # sums to head_dim * partial_rotary_factor / 2
    vision_hidden: int
    vq_embed: int
    glyph_d_model: int
    glyph_layers: int
    dit_layers: int
    dit_heads: int
    dit_head_dim: int
    dit_time_dim: int
    dit_condition_dim: int
    vae_channels: tuple[int, int, int, int]


SIZES = {
    "tiny": GlmImageSize(
        codebook=64, vocab_extra=600, ar_hidden=32, ar_intermediate=64, ar_layers=2, ar_heads=2, ar_kv_heads=1,
        mrope=(2, 1, 1), vision_hidden=32, vq_embed=16, glyph_d_model=32, glyph_layers=2, dit_layers=2,
        dit_heads=2, dit_head_dim=8, dit_time_dim=16, dit_condition_dim=8, vae_channels=(4, 8, 16, 16),
    ),
    "small": GlmImageSize(
        codebook=512, vocab_extra=2048, ar_hidden=384, ar_intermediate=1024, ar_layers=6, ar_heads=6,
        ar_kv_heads=2, mrope=(8, 4, 4), vision_hidden=64, vq_embed=32, glyph_d_model=64, glyph_layers=2,
        dit_layers=4, dit_heads=4, dit_head_dim=32, dit_time_dim=64, dit_condition_dim=32,
        vae_channels=(16, 32, 64, 64),
    ),
}


def special_tokens(codebook: int) -> list[str]:
    """Special tokens in id order: the visual tokens, image start/end, then the prompt's markers."""
    return ([f"<|dit_token_{i}|>" for i in range(codebook + 2)]
            + ["<|image|>", "<sop>", "<eop>", "<|endoftext|>", "<|user|>", "<|assistant|>"])


def chat_template(codebook: int) -> str:
    """User turns with text verbatim and each image as image-start, ``<|image|>`` (the processor expands it to
    the image's tokens), image-end. The processor appends the target grid(s) and the image-start token."""
    start, end = f"<|dit_token_{codebook}|>", f"<|dit_token_{codebook + 1}|>"
    return (
        "{% for message in messages %}{{ '<|user|>\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{{{{ '{start}<|image|>{end}' }}}}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}{% endfor %}{{ '<|assistant|>\\n' }}"
    )


def build_processor(s: GlmImageSize):
    """``GlmImageProcessor``: a byte-level BPE tokenizer trained here (no hub) and GLM-Image's image processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GlmImageImageProcessor, GlmImageProcessor, PreTrainedTokenizerFast

    specials = special_tokens(s.codebook)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=len(specials) + s.vocab_extra, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(4000), trainer=trainer)
    for i, t in enumerate(specials):
        assert tok.token_to_id(t) == i, f"special token {t} should have id {i}"
    template = chat_template(s.codebook)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=f"<|dit_token_{s.codebook}|>", eos_token=f"<|dit_token_{s.codebook + 1}|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"},
        chat_template=template, model_max_length=32768)
    image_processor = GlmImageImageProcessor(
        patch_size=16, temporal_patch_size=1, merge_size=1, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": GRID_FACTOR * GRID_FACTOR, "longest_edge": 2048 * 2048})
    return GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=template)


def build_ar_config(s: GlmImageSize, tokenizer):
    from transformers import GlmImageConfig

    head_dim = s.ar_hidden // s.ar_heads
    assert 2 * sum(s.mrope) == head_dim // 2, "mrope_section must sum to head_dim * partial_rotary_factor / 2"
    k = s.codebook
    text = {
        "vocab_size": len(tokenizer), "hidden_size": s.ar_hidden, "intermediate_size": s.ar_intermediate,
        "num_hidden_layers": s.ar_layers, "num_attention_heads": s.ar_heads, "num_key_value_heads": s.ar_kv_heads,
        "max_position_embeddings": 32768, "vision_vocab_size": k,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": list(s.mrope)},
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": k + 1,
    }
    vision = {"depth": 1, "hidden_size": s.vision_hidden, "num_heads": 2, "image_size": 64, "patch_size": 16,
              "intermediate_size": 2 * s.vision_hidden}
    vq = {"embed_dim": s.vq_embed, "num_embeddings": k, "latent_channels": s.vision_hidden}
    return GlmImageConfig(text_config=text, vision_config=vision, vq_config=vq,
                          image_token_id=tokenizer.convert_tokens_to_ids("<|image|>"),
                          image_start_token_id=k, image_end_token_id=k + 1)


def build_components(s: GlmImageSize, seed: int) -> dict:
    """The pipeline's components for size ``s``, each model built right after seeding torch."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImageTransformer2DModel
    from transformers import ByT5Tokenizer, GenerationConfig, GlmImageForConditionalGeneration, T5Config, T5EncoderModel

    processor = build_processor(s)
    glyph_tokenizer = ByT5Tokenizer()
    torch.manual_seed(seed)
    ar = GlmImageForConditionalGeneration(build_ar_config(s, processor.tokenizer)).eval()
    # With the default init (std 0.02) the visual-token logits spread by ~0.1 and attention is near uniform, so
    # sampling is near uniform too and the same seed draws the same tokens whatever the prompt: the AR stage's
    # output would barely depend on its input. Logits spread by ~3 and sharper attention make the drawn tokens
    # follow the prompt, as a trained model's do (measured on tiny: 1 in 24 prompt pairs drew identical 64x64
    # images' tokens with the default init, none with this one).
    with torch.no_grad():
        ar.lm_head.weight.normal_(std=LOGIT_SPREAD / s.ar_hidden ** 0.5)
        for layer in ar.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(ATTENTION_SHARPENING)
            layer.self_attn.k_proj.weight.mul_(ATTENTION_SHARPENING)
    ar.generation_config = GenerationConfig(
        do_sample=True, temperature=0.9, top_p=0.95, top_k=0, eos_token_id=s.codebook + 1,
        pad_token_id=processor.tokenizer.pad_token_id)

    torch.manual_seed(seed + 1)
    glyph = T5EncoderModel(T5Config(
        vocab_size=len(glyph_tokenizer), d_model=s.glyph_d_model, d_kv=s.glyph_d_model // 4, d_ff=2 * s.glyph_d_model,
        num_layers=s.glyph_layers, num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        dropout_rate=0.0)).eval()

    torch.manual_seed(seed + 2)
    transformer = GlmImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=s.dit_layers,
        attention_head_dim=s.dit_head_dim, num_attention_heads=s.dit_heads, text_embed_dim=s.glyph_d_model,
        time_embed_dim=s.dit_time_dim, condition_dim=s.dit_condition_dim,
        prior_vq_quantizer_codebook_size=s.codebook).eval()

    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, block_out_channels=s.vae_channels,
        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
        latent_channels=LATENT_CHANNELS, norm_num_groups=4, layers_per_block=1,
        latents_mean=[0.0] * LATENT_CHANNELS, latents_std=[1.0] * LATENT_CHANNELS).eval()
    return {"tokenizer": glyph_tokenizer, "processor": processor, "text_encoder": glyph,
            "vision_language_encoder": ar, "vae": vae, "transformer": transformer,
            "scheduler": FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)}


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight GLM-Image checkpoint to ``out_dir``; returns the path."""
    from diffusers import GlmImagePipeline

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    os.makedirs(out_dir, exist_ok=True)
    GlmImagePipeline(**build_components(SIZES[size], seed)).save_pretrained(out_dir, safe_serialization=True)
    write_marker(out_dir, "glm_image", size, seed)
    return out_dir
