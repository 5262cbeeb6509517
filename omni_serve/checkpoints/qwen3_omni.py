"""Deterministic random-weight Qwen3-Omni (MoE) checkpoints in the Hugging Face on-disk layout.

Contract: ``make_checkpoint(out_dir, size)`` writes config.json, generation_config.json, safetensors weights, a
locally trained tokenizer with a chat template and the processor files (Whisper feature extractor, a Qwen2-VL
image processor with Qwen3-Omni's 16-pixel patches) such that ``Qwen3OmniMoeForConditionalGeneration
.from_pretrained(out_dir)`` loads it as it would a real ``Qwen3-Omni-30B-A3B-Instruct`` directory, and its
``generate`` speaks (``return_audio=True``) with the checkpoint's voices (``talker_config.speaker_id``). The same
``size`` and ``seed`` always give the same weights. Every part of the real architecture is present at a small
scale: a mixture-of-experts thinker (audio tower, vision tower with deepstack mergers), a MoE talker with a shared
expert and its multi-token code predictor for the residual codebooks, and the causal ConvNet code2wav.

Token ids: the real checkpoint's special ids (``<|im_start|>`` 151644, the role words ``system``/``user``/
``assistant``, the tts tokens, the media tokens) are the ids of the same tokens in our tokenizer; the role words are
single tokens, as in the real vocabulary, because the talker finds the user and assistant turns by them. The
talker's codec vocabulary keeps the real layout: codes ``0 .. codebook_size-1``, then its control tokens
(pad/bos/eos, think tokens, speakers) above them and below ``vocab_size - 1024`` is not used; transformers'
``generate`` suppresses ``vocab_size - 1024 .. vocab_size`` except the codec eos.

Sizes (``SIZES``), parameters in millions (thinker with its towers / talker with its code predictor / code2wav):
- ``tiny``: 0.75 / 1.37 (0.82) / 0.75 = 2.9 M, for tests (text + speech ``generate`` in ~0.25 s on CPU);
- ``small``: 34.1 / 19.5 (8.5) / 8.4 = 62 M, for benchmarks on 2 cores.
Head sizes are 32 (tiny) and 64 (small), ones vLLM's CPU attention supports.

Not written: ``Qwen3OmniMoeProcessor``'s own files need its video processor, which needs torchvision; the parts it
wraps (tokenizer, feature extractor, image processor) are written and load on their own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from omni_serve.checkpoints.tokenizer import omni_chat_template

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
]
TOKEN_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
ROLE_WORDS = ("system", "user", "assistant")
# Codec control ids: the real checkpoint's, relative to the codebook (2048 codes)
CODEC = {"pad": 2148, "bos": 2149, "eos": 2150, "nothink": 2155, "think_bos": 2156, "think_eos": 2157}
VOICES = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}
CODEBOOK, CODEC_VOCAB = 2048, 3072

CHAT_TEMPLATE = omni_chat_template(
    "<|audio_start|><|audio_pad|><|audio_end|>", "<|vision_start|><|image_pad|><|vision_end|>",
    "<|vision_start|><|video_pad|><|vision_end|>")


@dataclass(frozen=True)
class Qwen3OmniSize:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    experts: int
    experts_per_token: int
    moe_intermediate: int
    audio_d: int
    audio_layers: int
    vision_d: int
    vision_depth: int
    talker_hidden: int
    talker_layers: int
    code_groups: int
    predictor_layers: int
    code2wav_hidden: int
    code2wav_layers: int
    decoder_dim: int


SIZES = {
    "tiny": Qwen3OmniSize(
        vocab=512, hidden=64, layers=2, heads=2, kv_heads=1, experts=4, experts_per_token=2, moe_intermediate=32,
        audio_d=64, audio_layers=2, vision_d=64, vision_depth=2, talker_hidden=64, talker_layers=2,
        code_groups=4, predictor_layers=1, code2wav_hidden=64, code2wav_layers=1, decoder_dim=64),
    "small": Qwen3OmniSize(
        vocab=2048, hidden=512, layers=6, heads=8, kv_heads=4, experts=8, experts_per_token=2,
        moe_intermediate=256, audio_d=256, audio_layers=4, vision_d=256, vision_depth=4, talker_hidden=256,
        talker_layers=4, code_groups=8, predictor_layers=2, code2wav_hidden=256, code2wav_layers=2,
        decoder_dim=256),
}


def _mrope(head_dim: int) -> list[int]:
    """Interleaved M-RoPE sections (t, h, w) summing to head_dim / 2 (Qwen3-Omni: 24/20/20 of 64)."""
    half = head_dim // 2
    hw = (half * 5 // 16)
    return [half - 2 * hw, hw, hw]


def build_config(size: Qwen3OmniSize, tokenizer):
    """The ``Qwen3OmniMoeConfig`` for a size; token ids point at our tokenizer's tokens."""
    from transformers import Qwen3OmniMoeConfig

    s, ids = size, TOKEN_ID
    role = {w: tokenizer.convert_tokens_to_ids(w) for w in ROLE_WORDS}
    head_dim = s.hidden // s.heads
    talker_head_dim = s.talker_hidden // s.heads
    media = {"audio_token_id": ids["<|audio_pad|>"], "image_token_id": ids["<|image_pad|>"],
             "video_token_id": ids["<|video_pad|>"]}
    text = {
        "vocab_size": len(tokenizer), "hidden_size": s.hidden, "intermediate_size": s.moe_intermediate * 4,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": head_dim, "num_experts": s.experts, "num_experts_per_tok": s.experts_per_token,
        "moe_intermediate_size": s.moe_intermediate, "max_position_embeddings": 8192,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope(head_dim),
                            "interleaved": True, "mrope_interleaved": True},
    }
    thinker = {
        **media, "audio_start_token_id": ids["<|audio_start|>"], "user_token_id": role["user"],
        # read by the thinker's rope index though not declared by its config class (the real config has them)
        "audio_end_token_id": ids["<|audio_end|>"], "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "text_config": text,
        "audio_config": {"num_mel_bins": 128, "encoder_layers": s.audio_layers, "encoder_attention_heads": 2,
                         "encoder_ffn_dim": s.audio_d * 2, "d_model": s.audio_d, "output_dim": s.hidden,
                         "downsample_hidden_size": 32, "n_window": 50, "n_window_infer": 400},
        "vision_config": {"depth": s.vision_depth, "hidden_size": s.vision_d, "intermediate_size": s.vision_d * 2,
                          "num_heads": 2, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "out_hidden_size": s.hidden, "num_position_embeddings": 2304,
                          "deepstack_visual_indexes": [0]},
    }
    talker = {
        **media, "num_code_groups": s.code_groups, "thinker_hidden_size": s.hidden, "accept_hidden_layer": s.layers // 2,
        # the talker reads the thinker's media rows at mid-depth, as the real checkpoint does (24 of 48 layers)
        "codec_eos_token_id": CODEC["eos"], "codec_nothink_id": CODEC["nothink"],
        "codec_think_bos_id": CODEC["think_bos"], "codec_think_eos_id": CODEC["think_eos"],
        "codec_pad_id": CODEC["pad"], "codec_bos_id": CODEC["bos"],
        "vision_start_token_id": ids["<|vision_start|>"], "audio_start_token_id": ids["<|audio_start|>"],
        "speaker_id": dict(VOICES), "spatial_merge_size": 2,  # the real config carries it (the talker reads it)
        "text_config": {
            "vocab_size": CODEC_VOCAB, "hidden_size": s.talker_hidden, "intermediate_size": s.talker_hidden * 2,
            "num_hidden_layers": s.talker_layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": talker_head_dim, "num_experts": s.experts, "num_experts_per_tok": s.experts_per_token,
            "moe_intermediate_size": s.moe_intermediate, "shared_expert_intermediate_size": s.talker_hidden * 2,
            "max_position_embeddings": 8192,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": _mrope(talker_head_dim), "interleaved": True,
                                "mrope_interleaved": True},
        },
        "code_predictor_config": {
            "vocab_size": CODEBOOK, "hidden_size": s.talker_hidden, "intermediate_size": s.talker_hidden * 2,
            "num_hidden_layers": s.predictor_layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "head_dim": talker_head_dim, "num_code_groups": s.code_groups,
        },
    }
    code2wav = {
        "codebook_size": CODEBOOK, "hidden_size": s.code2wav_hidden, "num_attention_heads": 2,
        "num_key_value_heads": 2, "num_hidden_layers": s.code2wav_layers, "intermediate_size": s.code2wav_hidden * 2,
        "num_quantizers": s.code_groups, "decoder_dim": s.decoder_dim, "sliding_window": 72,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=True,
        im_start_token_id=ids["<|im_start|>"], im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<tts_pad>"], tts_bos_token_id=ids["<tts_text_bos>"],
        tts_eos_token_id=ids["<tts_text_eod>"], system_token_id=role["system"], user_token_id=role["user"],
        assistant_token_id=role["assistant"])


def _tokenizer(vocab: int):
    from omni_serve.checkpoints.tokenizer import build_qwen_tokenizer

    extra = {"audio_token": "<|audio_pad|>", "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
             "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>",
             "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"}
    tok = build_qwen_tokenizer(SPECIAL_TOKENS, vocab, extra, CHAT_TEMPLATE)
    # the role words follow <|im_start|> in every turn and must be one token each (the talker finds the turns by
    # them); a small BPE vocabulary does not learn them, so they are added tokens (not special: they decode)
    tok.add_tokens(list(ROLE_WORDS))
    for word in ROLE_WORDS:
        if tok.encode(word) != [tok.convert_tokens_to_ids(word)]:
            raise RuntimeError(f"the tokenizer splits the role word {word!r}; the talker needs it whole")
    return tok


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight Qwen3-Omni checkpoint to ``out_dir``; returns the path."""
    import torch
    from transformers import GenerationConfig, Qwen3OmniMoeForConditionalGeneration

    from omni_serve.checkpoints.processor_files import save_omni_processor_parts

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = _tokenizer(SIZES[size].vocab)
    config = build_config(SIZES[size], tokenizer)
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    with torch.no_grad():
        _init_talker_experts(model, seed)
        # wide top-1 margins: greedy argmax stays stable across batch shapes
        model.thinker.lm_head.weight.mul_(8.0)
        model.talker.codec_head.weight.mul_(8.0)
    model.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=TOKEN_ID["<|im_end|>"], pad_token_id=TOKEN_ID["<|endoftext|>"]).save_pretrained(
        out_dir)
    save_omni_processor_parts(tokenizer, out_dir, "Qwen3OmniMoeProcessor", patch_size=16, min_pixels=64 * 64,
                              max_pixels=256 * 256)
    with open(os.path.join(out_dir, "omni_serve_checkpoint.json"), "w") as f:
        json.dump({"family": "qwen3_omni", "size": size, "seed": seed,
                   "parameters": sum(p.numel() for p in model.parameters())}, f, indent=2)
    return out_dir


def _init_talker_experts(model, seed: int) -> None:
    """Initialise the talker's expert MLPs, which transformers 5.23's ``_init_weights`` leaves as uninitialised
    memory (``torch.empty``: different garbage each run, sometimes +-1e21), as the rest: normal(0, initializer
    range), from a seeded generator so the checkpoint stays deterministic."""
    import torch

    std = model.config.talker_config.text_config.initializer_range
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.talker.named_parameters():
        if ".experts." in name:  # the fused expert weights (gate_up_proj, down_proj: [experts, ., .])
            param.normal_(0.0, std, generator=gen)
