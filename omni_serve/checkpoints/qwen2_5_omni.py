"""Deterministic random-weight Qwen2.5-Omni checkpoints in the Hugging Face on-disk layout.

Contract: ``make_checkpoint(out_dir, size)`` writes config.json, generation_config.json, safetensors
weights, a locally trained tokenizer with a chat template, the processor files (Whisper feature
extractor, Qwen2-VL image processor) and ``spk_dict.pt`` (per voice: ``bos_token``, ``cond``,
``ref_mel``) such that ``Qwen2_5OmniForConditionalGeneration.from_pretrained(out_dir)`` and
``AutoProcessor.from_pretrained(out_dir)`` load it as they would a real ``Qwen2.5-Omni-7B`` directory.
The same ``size`` always yields byte-identical weights (fixed seed). Sizes:

- ``tiny``: ~1 M parameters, for tests (a generate call takes well under a second on CPU);
- ``small``: tens of millions of parameters, so a decode step is dominated by model compute on CPU
  (used by benchmarks).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from omni_serve.checkpoints.tokenizer import omni_chat_template

log = logging.getLogger(__name__)

# Special tokens in id order (id = index). Names follow the real Qwen2.5-Omni tokenizer.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|spk_chelsie|>",
    "<|spk_ethan|>",
]
TOKEN_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
VOICES = {"Chelsie": "<|spk_chelsie|>", "Ethan": "<|spk_ethan|>"}

# Our own chat template (media parts become placeholders that the processor expands).
CHAT_TEMPLATE = omni_chat_template(
    "<|audio_bos|><|AUDIO|><|audio_eos|>", "<|vision_bos|><|IMAGE|><|vision_eos|>",
    "<|vision_bos|><|VIDEO|><|vision_eos|>")


@dataclass(frozen=True)
class OmniSize:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    mrope: tuple[int, int, int]
    audio_d: int
    audio_layers: int
    vision_d: int
    vision_depth: int
    talker_hidden: int
    talker_layers: int
    talker_intermediate: int
    dit_hidden: int
    dit_layers: int
    vocoder_channels: int


SIZES = {
    "tiny": OmniSize(
        vocab=512, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, mrope=(4, 6, 6),
        audio_d=64, audio_layers=2, vision_d=64, vision_depth=2,
        talker_hidden=64, talker_layers=2, talker_intermediate=128,
        dit_hidden=64, dit_layers=2, vocoder_channels=128,
    ),
    "small": OmniSize(
        vocab=2048, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=4, mrope=(8, 12, 12),
        audio_d=256, audio_layers=4, vision_d=256, vision_depth=4,
        talker_hidden=384, talker_layers=6, talker_intermediate=1024,
        dit_hidden=256, dit_layers=4, vocoder_channels=256,
    ),
}


def build_config(size: OmniSize, vocab_size: int):
    """The ``Qwen2_5OmniConfig`` for a size; token ids point at our tokenizer's special tokens."""
    from transformers import Qwen2_5OmniConfig

    s = size
    head_dim = s.hidden // s.heads
    assert sum(s.mrope) * 2 == head_dim, "mrope_section must sum to head_dim/2"
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": list(s.mrope)}
    ids = TOKEN_ID
    media_ids = {
        "audio_token_index": ids["<|AUDIO|>"],
        "image_token_index": ids["<|IMAGE|>"],
        "video_token_index": ids["<|VIDEO|>"],
        "audio_start_token_id": ids["<|audio_bos|>"],
        "audio_end_token_id": ids["<|audio_eos|>"],
        "vision_start_token_id": ids["<|vision_bos|>"],
    }
    talker_head_dim = s.talker_hidden // s.heads
    thinker = {
        **media_ids,
        "user_token_id": ids["<|im_start|>"],
        "text_config": {
            "vocab_size": vocab_size, "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "max_position_embeddings": 4096, "rope_parameters": rope, "tie_word_embeddings": False,
            "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
        },
        "audio_config": {
            "num_mel_bins": 128, "encoder_layers": s.audio_layers, "encoder_attention_heads": 4,
            "encoder_ffn_dim": s.audio_d * 2, "d_model": s.audio_d, "output_dim": s.hidden,
            "max_source_positions": 1500, "n_window": 100,
        },
        "vision_config": {
            "depth": s.vision_depth, "hidden_size": s.vision_d, "intermediate_size": s.vision_d * 2,
            "num_heads": 4, "out_hidden_size": s.hidden, "fullatt_block_indexes": [s.vision_depth - 1],
            "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
        },
    }
    talker_mrope = _mrope_for(talker_head_dim)
    talker = {
        **media_ids,
        "vision_end_token_id": ids["<|vision_eos|>"],
        "vocab_size": 8448,  # the real codec vocabulary: codec special ids 8292..8296 as in Qwen2.5-Omni-7B
        "tts_text_start_token_id": ids["<tts_text_bos>"],
        "tts_text_end_token_id": ids["<tts_text_eod>"],
        "tts_text_pad_token_id": ids["<tts_pad>"],
        "embedding_size": s.hidden, "hidden_size": s.talker_hidden,
        "intermediate_size": s.talker_intermediate, "num_hidden_layers": s.talker_layers,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": talker_head_dim,
        "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": talker_mrope},
        "spatial_merge_size": 2,
    }
    token2wav = {
        "dit_config": {
            "hidden_size": s.dit_hidden, "num_hidden_layers": s.dit_layers, "num_attention_heads": 4,
            "head_dim": s.dit_hidden // 4, "emb_dim": 64, "ff_mult": 2, "num_embeds": 8448, "mel_dim": 80,
            "repeats": 2, "block_size": 24, "look_ahead_layers": [1], "look_backward_layers": [0],
            "enc_emb_dim": 64, "enc_dim": 64, "enc_channels": [64, 64, 64, 64, 192],
            "enc_attention_channels": 16, "enc_se_channels": 16, "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        },
        "bigvgan_config": {
            "mel_dim": 80, "upsample_initial_channel": s.vocoder_channels,
            "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1, 3, 5]],
            "upsample_rates": [5, 3, 2, 2, 2, 2], "upsample_kernel_sizes": [11, 7, 4, 4, 4, 4],
        },
    }
    return Qwen2_5OmniConfig(
        thinker_config=thinker, talker_config=talker, token2wav_config=token2wav, enable_audio_output=True
    )


def _mrope_for(head_dim: int) -> list[int]:
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight Qwen2.5-Omni checkpoint to ``out_dir``; returns the path."""
    import torch
    from transformers import GenerationConfig, Qwen2_5OmniForConditionalGeneration

    from omni_serve.checkpoints.processor_files import save_omni_processor_parts
    from omni_serve.checkpoints.tokenizer import build_qwen_tokenizer

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    spec = SIZES[size]
    os.makedirs(out_dir, exist_ok=True)
    extra_special = {
        "audio_token": "<|AUDIO|>", "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
        "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
        "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    }
    tokenizer = build_qwen_tokenizer(SPECIAL_TOKENS, spec.vocab, extra_special, CHAT_TEMPLATE)
    config = build_config(spec, vocab_size=len(tokenizer))

    torch.manual_seed(seed)
    model = Qwen2_5OmniForConditionalGeneration(config).eval()
    _spread_logits(model)
    model.save_pretrained(out_dir)
    GenerationConfig(
        eos_token_id=TOKEN_ID["<|im_end|>"],
        pad_token_id=TOKEN_ID["<|endoftext|>"],
    ).save_pretrained(out_dir)

    # Qwen2_5OmniProcessor's parts (omni_serve.models.qwen2_5_omni_inputs expands the placeholders as it does)
    save_omni_processor_parts(tokenizer, out_dir, "Qwen2_5OmniProcessor", patch_size=14, min_pixels=56 * 56,
                              max_pixels=224 * 224)

    gen = torch.Generator().manual_seed(seed + 1)
    enc_emb_dim = config.token2wav_config.dit_config.enc_emb_dim
    mel_dim = config.token2wav_config.dit_config.mel_dim
    speakers = {
        name: {
            "bos_token": TOKEN_ID[token],
            "cond": torch.randn(1, enc_emb_dim, generator=gen),
            "ref_mel": torch.randn(1, 120, mel_dim, generator=gen),
        }
        for name, token in VOICES.items()
    }
    torch.save(speakers, os.path.join(out_dir, "spk_dict.pt"))
    with open(os.path.join(out_dir, "omni_serve_checkpoint.json"), "w") as f:
        json.dump({"family": "qwen2_5_omni", "size": size, "seed": seed}, f, indent=2)
    return out_dir


def _spread_logits(model) -> None:
    """Random init gives near-uniform logits, where greedy ties make argmax fragile across batch shapes.

    Scale the output heads so top-1 margins are wide; still random weights, still loaded as-is.
    """
    import torch

    with torch.no_grad():
        model.thinker.lm_head.weight.mul_(8.0)
        model.talker.codec_head.weight.mul_(8.0)
