"""Deterministic random-weight Qwen3-ASR checkpoints in the Hugging Face on-disk layout (``Qwen/Qwen3-ASR-*-hf``).

Contract: ``make_checkpoint(out_dir, size, seed)`` writes config.json, generation_config.json, model.safetensors, a
locally trained tokenizer, ``chat_template.jinja`` and ``processor_config.json`` (the processor with its
``Qwen3ASRFeatureExtractor``, as transformers 5 saves it) plus ``omni_serve_checkpoint.json`` (last), such that
``Qwen3ASRForConditionalGeneration.from_pretrained(out_dir)`` (or ``AutoModel``: the headless ``Qwen3ASRModel``) and
``AutoProcessor.from_pretrained(out_dir)`` (a ``Qwen3ASRProcessor``) load it offline as they would a real
``Qwen3-ASR-1.7B-hf`` directory: ``processor.apply_transcription_request(audio, language=...)`` builds the prompt
and features and ``generate`` transcribes. The same ``size`` and ``seed`` always yield byte-identical weights.

Kept from the real model (what the processor and model depend on): 128 mel bins at 16 kHz (hop 160, n_fft 400),
encoder chunks of ``2 * n_window`` = 100 mel frames, each giving 13 audio tokens (three stride-2 convolutions; the
encoder's 13 sinusoidal positions), attention windows of ``n_window_infer`` = 800 frames (8 chunks, 104 tokens), the
processor's placeholder expansion (one ``<|audio_pad|>`` per audio token between ``<|audio_start|>`` and
``<|audio_end|>``), the chat template's layout (an empty system turn when none is given, the assistant turn
prefilled with ``language <Name><asr_text>`` to force a language), ``<asr_text>`` as an added *non-special* token
(``decode(..., return_format="parsed")`` skips special tokens and then splits on it), ``<timestamp>`` (the config's
``timestamp_token_id``), eos ``<|endoftext|>``/``<|im_end|>``, pad ``<|im_end|>``, a Qwen3 text model with tied
embeddings and rope theta 1e6 (plain 1-D RoPE, as transformers' port runs it). Token ids are those of the same
tokens in our small vocabulary (``TOKEN_ID``), not the real 151k ids. Widths and depths shrink, and two init
tweaks make random weights behave: the audio convolutions get fan-in scaled weights (else the mel content vanishes
under the encoder's positions) and the decoder blocks' matrices are scaled by ``LLM_GAIN`` (else, the head being tied
to the embeddings, every step repeats its input token): the transcript then depends on the audio, not its length.

- ``tiny``: ~0.2 M parameters, for tests (16 greedy tokens on 2 s of audio in well under a second on CPU);
- ``small``: ~25 M parameters (encoder 4 x 256, LLM 6 x 512), so a decode step is model compute on CPU
  (benchmarks).
Head sizes are 32 (tiny) and 64 (small), ones vLLM's CPU attention supports.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omni_serve.checkpoints import write_marker

# Special tokens in id order (id = index); names as in the real Qwen3-ASR tokenizer.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
# Added after training, not special: they survive ``skip_special_tokens``, which ``<asr_text>`` must (the processor's
# parsed decode skips special tokens, then splits on it).
ADDED_TOKENS = ["<asr_text>", "<timestamp>"]
TOKEN_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
LANGUAGES = ("English", "Chinese", "French", "German", "Spanish", "Japanese", "Korean", "Russian")

# The real template's layout: a system turn always (empty if none is given), media parts become the audio
# placeholder (the processor expands <|audio_pad|>), text parts render as they are; nothing is trimmed, so
# ``continue_final_message`` with an empty assistant prefill renders exactly the generation prompt.
CHAT_TEMPLATE = (
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part['type'] == 'audio' or part['type'] == 'input_audio' or part['type'] == 'audio_url' %}"
    "{{ '<|audio_start|><|audio_pad|><|audio_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}{{ render(message['content']) }}{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

LLM_GAIN = 8.0  # the decoder blocks' matrices, scaled after init (see make_checkpoint)
# The real feature extractor's settings (Qwen3-ASR-1.7B-hf preprocessor_config.json).
FEATURES = {"feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400,
            "padding_value": 0.0, "dither": 0.0, "return_attention_mask": True, "n_window": 50, "min_length": 8000}


@dataclass(frozen=True)
class Qwen3ASRSize:
    vocab: int
    audio_d: int
    audio_layers: int
    audio_heads: int
    audio_ffn: int
    downsample: int  # the conv stack's channels (480 in the real model)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int


SIZES = {
    "tiny": Qwen3ASRSize(vocab=1024, audio_d=32, audio_layers=2, audio_heads=2, audio_ffn=64, downsample=8,
                         hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1),
    "small": Qwen3ASRSize(vocab=2048, audio_d=256, audio_layers=4, audio_heads=4, audio_ffn=1024, downsample=64,
                          hidden=512, intermediate=1536, layers=6, heads=8, kv_heads=4),
}


def build_config(size: Qwen3ASRSize, tokenizer):
    """The ``Qwen3ASRConfig`` for a size; token ids point at our tokenizer's tokens."""
    from transformers import Qwen3ASRConfig

    s = size
    eos = [TOKEN_ID["<|endoftext|>"], TOKEN_ID["<|im_end|>"]]
    audio = {
        "num_mel_bins": FEATURES["feature_size"], "encoder_layers": s.audio_layers,
        "encoder_attention_heads": s.audio_heads, "encoder_ffn_dim": s.audio_ffn, "d_model": s.audio_d,
        "output_dim": s.hidden, "downsample_hidden_size": s.downsample, "n_window": FEATURES["n_window"],
        "n_window_infer": 800, "max_position_embeddings": 13, "activation_function": "gelu",
    }
    text = {
        "vocab_size": len(tokenizer), "hidden_size": s.hidden, "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
        "head_dim": s.hidden // s.heads, "max_position_embeddings": 65536, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rms_norm_eps": 1e-6,
        "bos_token_id": TOKEN_ID["<|endoftext|>"], "eos_token_id": eos, "pad_token_id": TOKEN_ID["<|im_end|>"],
    }
    return Qwen3ASRConfig(
        audio_config=audio, text_config=text, audio_token_id=TOKEN_ID["<|audio_pad|>"],
        timestamp_token_id=tokenizer.convert_tokens_to_ids("<timestamp>"), pad_token_id=TOKEN_ID["<|im_end|>"],
        eos_token_id=eos, tie_word_embeddings=True)


def build_tokenizer(vocab: int):
    """A Qwen-style byte-level BPE tokenizer with the real special-token names, the transcription prefixes in its
    training text (``language English`` etc. become few tokens) and ``<asr_text>``/``<timestamp>`` added."""
    from omni_serve.checkpoints.tokenizer import build_qwen_tokenizer

    extra = {"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
    corpus = [f"language {name}" for name in LANGUAGES for _ in range(20)] + ["system user assistant"] * 50
    tok = build_qwen_tokenizer(SPECIAL_TOKENS, vocab, extra, CHAT_TEMPLATE, extra_corpus=corpus)
    tok.add_tokens(ADDED_TOKENS)
    for token in ADDED_TOKENS:
        if tok.encode(f"a{token}b")[1:2] != [tok.convert_tokens_to_ids(token)]:
            raise RuntimeError(f"the tokenizer splits {token!r}")
    return tok


def build_processor(tokenizer):
    from transformers import Qwen3ASRFeatureExtractor, Qwen3ASRProcessor

    return Qwen3ASRProcessor(feature_extractor=Qwen3ASRFeatureExtractor(**FEATURES), tokenizer=tokenizer,
                             chat_template=CHAT_TEMPLATE)


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight Qwen3-ASR checkpoint to ``out_dir``; returns the path."""
    import torch
    from transformers import GenerationConfig, Qwen3ASRForConditionalGeneration

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(SIZES[size].vocab)
    config = build_config(SIZES[size], tokenizer)
    torch.manual_seed(seed)
    model = Qwen3ASRForConditionalGeneration(config).eval()
    with torch.no_grad():
        _init_conv_stack(model, seed)
        # At the initializer's 0.02 the decoder blocks add next to nothing to the residual stream, and with the
        # head tied to the embeddings every step then repeats its input token whatever the audio: stronger blocks
        # (std 0.16) make the output depend on the prompt and the audio.
        for param in model.model.language_model.layers.parameters():
            if param.dim() == 2:
                param.mul_(LLM_GAIN)
        # wide top-1 margins (as the other writers' heads); the head is tied, so the final norm is scaled instead
        model.model.language_model.norm.weight.mul_(8.0)
    model.save_pretrained(out_dir)
    GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
                     bos_token_id=TOKEN_ID["<|endoftext|>"], do_sample=False).save_pretrained(out_dir)
    build_processor(tokenizer).save_pretrained(out_dir)
    write_marker(out_dir, "qwen3_asr", size, seed)
    return out_dir


def _init_conv_stack(model, seed: int) -> None:
    """Re-initialise the audio encoder's convolutional downsampling (three 3x3 stride-2 convolutions, then the
    linear ``conv_out``) with fan-in scaled normals (He for the GELU convolutions), from a seeded generator. At the
    initializer's 0.02 each layer shrinks its input ~10x: the mel content reaches ``conv_out`` at ~1e-4 against the
    encoder's unit sinusoidal positions, and the transcript would depend on the audio's length only."""
    import math

    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    tower = model.model.audio_tower
    for layer, gain in ((tower.conv2d1, 2.0), (tower.conv2d2, 2.0), (tower.conv2d3, 2.0), (tower.conv_out, 1.0)):
        fan_in = layer.weight[0].numel()
        layer.weight.normal_(0.0, math.sqrt(gain / fan_in), generator=gen)
