"""Deterministic random-weight VibeVoice (text-to-speech with voice cloning) checkpoints in the Hugging Face layout.

Contract: ``make_checkpoint(out_dir, size, seed)`` writes config.json, generation_config.json, safetensors weights
and the processor files (a locally trained Qwen2-style BPE tokenizer, ``VibeVoiceAcousticTokenizerFeatureExtractor``
settings, the VibeVoice script chat template, ``processor_config.json``), then ``omni_serve_checkpoint.json`` last,
such that transformers' ``VibeVoiceForConditionalGeneration.from_pretrained(out_dir)`` (``AutoModelForTextToWaveform``)
and ``VibeVoiceProcessor.from_pretrained(out_dir)`` (``AutoProcessor``) load it offline as they would the converted
``VibeVoice-1.5B-hf`` directory, and ``generate`` speaks with a cloned voice. The same ``size`` and ``seed`` always
give byte-identical weights (torch is seeded before the model is built).

Kept from the real model, where the processor or ``generate`` depend on it: 24 kHz audio; the acoustic tokenizer's
downsampling ratios (2, 2, 4, 5, 5, 8): a hop of 3200 samples, 7.5 latent frames a second, one speech token per
frame; its 64-wide latents (the diffusion head's ``latent_size``) and ``vae_std``; the semantic encoder's 128-wide
features; the causal convolutions (kernel 7) that stream through a padding cache; the speech tokens
(``<|vision_start|>``/``<|vision_end|>``/``<|vision_pad|>``: audio bos/eos/placeholder; ``<|endoftext|>``: eos and
pad); tied word embeddings (the 1.5B's); the generation config (greedy, ``guidance_scale`` 1.3, diffusers'
``DPMSolverMultistepScheduler`` with a ``squaredcos_cap_v2`` schedule and ``v_prediction``, 10 diffusion steps per
speech token). Shrunk: widths and depths of the Qwen2 LM, diffusion head and both tokenizers.

Random weights would emit an arbitrary one of the four tokens ``generate`` allows (speech, audio bos/eos, eos); here
the LM always emits the speech token (``<|vision_pad|>``), by a wide margin: every input embedding (token rows and
both connectors' output bias) carries a constant in channel 0 that the final norm keeps and only the speech token's
(tied) row weighs heavily. Speech therefore runs until ``max_new_tokens`` (the generation config's default here:
``SIZES[size].new_tokens``), one 3200-sample chunk per token: ``max_new_tokens=8`` gives 25600 samples (~1.07 s).
The diffusion condition (the LM's last hidden state) still depends on the script and the reference voice: the
weights are re-drawn at 1 / sqrt(fan in) (``_init_for_signal``), transformers' init leaves the tokenizers near
zero and every voice encoding alike.

Sizes (``SIZES``), parameters in millions (LM / diffusion head / acoustic tokenizer / semantic encoder):

- ``tiny``: 0.11 / 0.14 / 0.79 / 0.45 = 1.5 M (6 MB), for tests: 8 speech tokens (~1.07 s of audio) take ~0.2 s on
  CPU once warm;
- ``small``: 10.1 / 7.8 / 6.4 / 3.3 = 28 M (112 MB), for benchmarks: 75 tokens (10 s of audio) take ~7 s on 2 CPU
  threads, spread over the LM's three passes a token, the diffusion head and the streaming decoder and encoder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omni_serve.checkpoints import write_marker

SAMPLE_RATE = 24000
DOWNSAMPLING_RATIOS = (2, 2, 4, 5, 5, 8)  # the acoustic and semantic encoders' strides: a hop of 3200 samples
HOP_LENGTH = 3200
ACOUSTIC_DIM = 64  # acoustic latents (vae_dim): the diffusion head's latent_size
SEMANTIC_DIM = 128  # semantic encoder features
VAE_STD = 0.625  # the real acoustic tokenizer's (fix_std 0.5 / 0.8)
AUDIO_GAIN = 1 / 32  # on the acoustic decoder's last conv (see _init_for_signal)

# Qwen2.5's special tokens in their real order (id = index here; the real ones start at 151643).
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
]
TOKEN_ID = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN, EOS = "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|endoftext|>"

# The converted checkpoints' generation config (transformers' convert_vibevoice_to_hf.py), plus the number of
# diffusion steps generate defaults to (the original demo's 10).
NOISE_SCHEDULER_CLASS = "DPMSolverMultistepScheduler"
NOISE_SCHEDULER_CONFIG = {"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}
GUIDANCE_SCALE = 1.3
NUM_DIFFUSION_STEPS = 10

# The converted checkpoints' chat template (processor): one "Speaker <role>:" line per text part, a voice prompt
# per speaker with an audio part (bos, one placeholder the processor expands to ceil(samples / 3200), eos), and the
# prompt ends with the audio bos token (speech follows).
CHAT_TEMPLATE = """{%- set system_prompt = system_prompt | default(" Transform the text provided by various speakers \
into speech output, utilizing the distinct voice of each respective speaker.\\n") -%}
{{ system_prompt -}}
{%- set audio_bos_token = audio_bos_token | default("<|vision_start|>") %}
{%- set audio_eos_token = audio_eos_token | default("<|vision_end|>") %}
{%- set audio_token = audio_token | default("<|vision_pad|>") %}
{%- set ns = namespace(speakers_with_audio="") %}
{%- for message in messages %}
    {%- set role = message['role'] %}
    {%- set content = message['content'] %}
    {%- set has_audio = content | selectattr('type', 'equalto', 'audio') | list | length > 0 %}
    {%- if has_audio and role not in ns.speakers_with_audio %}
        {%- set ns.speakers_with_audio = ns.speakers_with_audio + role + "," %}
    {%- endif %}
{%- endfor %}

{%- if ns.speakers_with_audio %}
{{ " Voice input:\\n" }}
{%- for speaker in ns.speakers_with_audio.rstrip(',').split(',') %}
{%- if speaker %}
 Speaker {{ speaker }}:{{ audio_bos_token }}{{ audio_token }}{{ audio_eos_token }}{{ "\\n" }}
{%- endif %}
{%- endfor %}
{%- endif %}
 Text input:{{ "\\n" }}

{%- for message in messages %}
    {%- set role = message['role'] %}
    {%- set text_items = message['content'] | selectattr('type', 'equalto', 'text') | list %}
    {%- for item in text_items %}
 Speaker {{ role }}: {{ item['text'] }}{{ "\\n" }}
    {%- endfor %}
{%- endfor %}
 Speech output:{{ "\\n" }}{{ audio_bos_token }}"""
# Template words, so that they are whole tokens as in the real vocabulary
_TEMPLATE_CORPUS = [
    " Transform the text provided by various speakers into speech output, utilizing the distinct voice of each "
    "respective speaker.\n Voice input:\n Speaker 0:\n Speaker 1:\n Text input:\n Speech output:\n"] * 400


@dataclass(frozen=True)
class VibeVoiceSize:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_layers: int  # diffusion head layers (the real: 4, ffn 3x hidden)
    filters: int  # the tokenizers' first conv width (real: 32; doubles at each of the 6 downsamplings)
    depths: tuple[int, ...]  # ConvNeXt blocks per stage (real: 3, 3, 3, 3, 3, 3, 8)
    new_tokens: int  # generation_config.max_new_tokens (the real: 40500)


SIZES = {
    "tiny": VibeVoiceSize(vocab=512, hidden=64, intermediate=128, layers=2, heads=2, kv_heads=1, head_layers=2,
                          filters=2, depths=(1, 1, 1, 1, 1, 1, 1), new_tokens=8),
    "small": VibeVoiceSize(vocab=2048, hidden=384, intermediate=1024, layers=6, heads=6, kv_heads=2, head_layers=4,
                           filters=4, depths=(2, 2, 2, 2, 2, 2, 4), new_tokens=75),
}


def _tokenizer(vocab: int):
    from omni_serve.checkpoints.tokenizer import build_qwen_tokenizer

    tok = build_qwen_tokenizer(SPECIAL_TOKENS, vocab, {}, None, extra_corpus=_TEMPLATE_CORPUS)
    tok.eos_token = EOS  # Qwen2.5 base (VibeVoice's LM): <|endoftext|> ends text and pads
    return tok


def build_config(s: VibeVoiceSize, vocab_size: int):
    """The ``VibeVoiceConfig`` for a size; token ids point at our tokenizer's tokens."""
    from transformers import VibeVoiceConfig

    tokenizer = {"hidden_size": ACOUSTIC_DIM, "num_filters": s.filters, "depths": list(s.depths),
                 "downsampling_ratios": list(DOWNSAMPLING_RATIOS), "kernel_size": 7, "rms_norm_eps": 1e-5,
                 "layer_scale_init_value": 1e-6, "ffn_expansion": 4, "hidden_act": "gelu"}
    return VibeVoiceConfig(
        text_config={
            "model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": s.hidden,
            "intermediate_size": s.intermediate, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
            "num_key_value_heads": s.kv_heads, "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "tie_word_embeddings": True,
            "use_sliding_window": False, "hidden_act": "silu",
        },
        audio_config={"model_type": "vibevoice_acoustic_tokenizer", **tokenizer, "vae_std": VAE_STD},
        semantic_model_config={"model_type": "vibevoice_acoustic_tokenizer_encoder",
                               **{**tokenizer, "hidden_size": SEMANTIC_DIM}},
        diffusion_head_config={"hidden_size": s.hidden, "latent_size": ACOUSTIC_DIM,
                               "num_hidden_layers": s.head_layers, "intermediate_size": 3 * s.hidden,
                               "rms_norm_eps": 1e-5, "hidden_act": "silu", "frequency_embedding_size": 256},
        pad_token_id=TOKEN_ID[EOS], eos_token_id=TOKEN_ID[EOS], audio_bos_token_id=TOKEN_ID[AUDIO_BOS],
        audio_eos_token_id=TOKEN_ID[AUDIO_EOS], audio_token_id=TOKEN_ID[AUDIO_TOKEN],
    )


def build_model(size: str = "tiny", seed: int = 0):
    """The random-weight model and processor for ``size`` (built after seeding torch with ``seed``)."""
    import torch
    from transformers import (VibeVoiceAcousticTokenizerFeatureExtractor, VibeVoiceForConditionalGeneration,
                              VibeVoiceProcessor)

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    s = SIZES[size]
    tokenizer = _tokenizer(s.vocab)
    torch.manual_seed(seed)
    model = VibeVoiceForConditionalGeneration(build_config(s, len(tokenizer))).eval()
    _init_for_signal(model, s, seed)
    g = model.generation_config
    g.max_new_tokens, g.do_sample, g.guidance_scale = s.new_tokens, False, GUIDANCE_SCALE
    g.noise_scheduler_class, g.noise_scheduler_config = NOISE_SCHEDULER_CLASS, dict(NOISE_SCHEDULER_CONFIG)
    g.num_diffusion_steps = NUM_DIFFUSION_STEPS
    g.pad_token_id = g.eos_token_id = TOKEN_ID[EOS]
    g._from_model_config = False
    feature_extractor = VibeVoiceAcousticTokenizerFeatureExtractor(
        feature_size=1, sampling_rate=SAMPLE_RATE, padding_value=0.0, normalize_audio=True, target_dB_FS=-25,
        eps=1e-6, pad_to_multiple_of=HOP_LENGTH)
    processor = VibeVoiceProcessor(feature_extractor=feature_extractor, tokenizer=tokenizer,
                                   chat_template=CHAT_TEMPLATE)
    return model, processor


def _init_for_signal(model, s: VibeVoiceSize, seed: int) -> None:
    """Re-draw the weights so that signals neither vanish nor explode, and make the speech token the LM's choice.

    transformers' init (normal with std 0.01-0.02, ConvNeXt layer scales of 1e-6) leaves the acoustic tokenizer
    near zero: every reference voice encodes to the same latents (the VAE noise drowns them) and the script barely
    moves the diffusion condition. Here every linear and convolution weight is normal(0, 1 / sqrt(fan in)), biases
    zero, token embeddings normal(0, 1), the ConvNeXt layer scales 0.5: each layer keeps its input's scale (the
    acoustic decoder's last conv is scaled down by ``AUDIO_GAIN``).

    The speech token: channel 0 of every input embedding (each token row, each connector's output bias) is
    ``sqrt(hidden)``, as large as all other channels together, so the final norm's channel 0 is large and positive
    whatever the input; the speech token's (tied) row weighs channel 0 twice as much as any other row and the four
    rows ``generate`` allows (speech, audio bos/eos, eos) are near zero elsewhere (else the last position's state,
    which keeps its own input embedding, audio bos at the end of the prompt, would favour that token): the speech
    token leads the other three by channel 0 times sqrt(hidden), tens of logits."""
    import math

    import torch
    from torch import nn

    gen = torch.Generator().manual_seed(seed + 1)
    offset = math.sqrt(s.hidden)
    with torch.no_grad():
        for module in model.modules():
            if module is model.lm_head:  # tied to the token embeddings
                continue
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.ConvTranspose1d)):
                w = module.weight
                if isinstance(module, nn.ConvTranspose1d):  # (in, out, k): each output sums in * k / stride inputs
                    fan_in = w.shape[0] * w.shape[2] / module.stride[0]
                else:
                    fan_in = w[0].numel()
                w.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, 1.0, generator=gen)
            elif hasattr(module, "ffn_gamma"):  # the tokenizers' ConvNeXt blocks
                module.gamma.fill_(0.5)
                module.ffn_gamma.fill_(0.5)
        # speech at a speech-like level (rms ~0.1, peaks below 1) rather than the unit scale of the layers before
        model.model.audio_tower.decoder.head.conv.weight.mul_(AUDIO_GAIN)
        embed = model.model.language_model.embed_tokens.weight  # tied: also the LM head
        embed[:, 0] = offset
        allowed = [TOKEN_ID[t] for t in (AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN, EOS)]
        embed[allowed, 1:] *= 0.01  # no row the final state resembles by its own input (audio bos ends the prompt)
        embed[TOKEN_ID[AUDIO_TOKEN], 0] = 2 * offset
        for connector in (model.model.multi_modal_projector, model.model.semantic_connector):
            connector.linear_2.bias[0] = offset


def make_checkpoint(out_dir: str, size: str = "tiny", seed: int = 0) -> str:
    """Write a deterministic random-weight VibeVoice checkpoint to ``out_dir``; returns the path."""
    model, processor = build_model(size, seed)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    write_voices(os.path.join(out_dir, VOICES_DIR))
    write_marker(out_dir, "vibevoice", size, seed)
    return out_dir


VOICES_DIR = "voices"  # preset reference voices, one WAV per name (what the served graph offers as `voice`)
PRESETS = {"alice": 210.0, "bob": 115.0}  # name -> pitch (Hz) of its synthetic clip


def write_voices(voices_dir: str, seconds: float = 2.0) -> None:
    """Synthetic preset voices (24 kHz mono WAVs): a pitch's harmonics, shaped into syllables. Random weights hear
    no real voice, so these only have to differ; a real deployment puts recorded reference clips here."""
    import numpy as np
    import soundfile as sf

    os.makedirs(voices_dir, exist_ok=True)
    t = np.arange(int(seconds * 24000)) / 24000
    for name, pitch in PRESETS.items():
        wave = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in range(1, 6))
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2  # ~8 syllables a second
        sf.write(os.path.join(voices_dir, f"{name}.wav"), (0.2 * wave * envelope).astype(np.float32), 24000,
                 subtype="PCM_16")
