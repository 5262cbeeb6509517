"""The tiny random-weight VibeVoice checkpoint loads in transformers' processor and model, and ``generate`` clones a
reference voice: deterministically under a fixed seed, its speech latents following the script and the voice; the
acoustic decoder streams exactly; the same size and seed write the same bytes."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from omni_serve.checkpoints.vibevoice import (AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN, EOS, HOP_LENGTH, SAMPLE_RATE,
                                              make_checkpoint)
from tests.unit.test_qwen_image_checkpoint import _safetensors

TEXT = "Hello world, this is a test."
NEW_TOKENS = 8  # 8 x 3200 samples: ~1.07 s


@pytest.fixture(scope="module")
def loaded(vibevoice_tiny_dir):
    from transformers import AutoModelForTextToWaveform, AutoProcessor

    # one thread: the tiny model's many small ops run ~10x slower on two threads when the cores are shared
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield AutoProcessor.from_pretrained(vibevoice_tiny_dir), AutoModelForTextToWaveform.from_pretrained(
            vibevoice_tiny_dir).eval()
    finally:
        torch.set_num_threads(threads)


def _voice(seed: int = 0, hz: float = 220.0, seconds: float = 1.5) -> np.ndarray:
    """A seeded synthetic 24 kHz reference clip: a tone with a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    return (0.3 * np.sin(2 * np.pi * hz * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def _inputs(processor, text: str = TEXT, voice: np.ndarray | None = None):
    content = [{"type": "text", "text": text}, {"type": "audio", "audio": _voice() if voice is None else voice}]
    # 5.23's VibeVoiceProcessor has no text defaults: without return_tensors the ids come back as lists
    return processor.apply_chat_template([{"role": "0", "content": content}], tokenize=True, return_dict=True,
                                         return_tensors="pt", processor_kwargs={"sampling_rate": SAMPLE_RATE})


def _generate(model, inputs, seed: int = 0):
    """(audio, speech latents, sequences) of a seeded ``generate``; the diffusion head's noise (and the reference
    voice's VAE noise) come from torch's global RNG, which ``generate`` offers no generator for."""
    latents = []
    sample = model._sample_audio_latent
    model._sample_audio_latent = lambda *a, **k: latents.append(sample(*a, **k)) or latents[-1]
    try:
        torch.manual_seed(seed)
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
    finally:
        del model._sample_audio_latent
    return out.audio[0], torch.cat(latents).squeeze(1), out.sequences


def test_layout_and_configs(vibevoice_tiny_dir, loaded):
    processor, model = loaded
    with open(os.path.join(vibevoice_tiny_dir, "omni_serve_checkpoint.json")) as f:
        assert json.load(f) == {"family": "vibevoice", "size": "tiny", "seed": 0}
    assert type(model).__name__ == "VibeVoiceForConditionalGeneration"
    assert type(processor).__name__ == "VibeVoiceProcessor"
    assert type(processor.feature_extractor).__name__ == "VibeVoiceAcousticTokenizerFeatureExtractor"
    c, fe, tok = model.config, processor.feature_extractor, processor.tokenizer
    assert fe.sampling_rate == SAMPLE_RATE and fe.pad_to_multiple_of == c.audio_config.hop_length == HOP_LENGTH
    assert c.diffusion_head_config.latent_size == c.audio_config.hidden_size == 64
    assert c.semantic_model_config.hidden_size == 128
    ids = {t: tok.convert_tokens_to_ids(t) for t in (AUDIO_BOS, AUDIO_EOS, AUDIO_TOKEN, EOS)}
    assert (c.audio_bos_token_id, c.audio_eos_token_id, c.audio_token_id) == (ids[AUDIO_BOS], ids[AUDIO_EOS],
                                                                             ids[AUDIO_TOKEN])
    assert (processor.audio_bos_token_id, processor.audio_eos_token_id, processor.audio_token_id) == (
        c.audio_bos_token_id, c.audio_eos_token_id, c.audio_token_id)
    assert c.eos_token_id == c.pad_token_id == tok.eos_token_id == tok.pad_token_id == ids[EOS]
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    g = model.generation_config
    assert (g.do_sample, g.guidance_scale, g.num_diffusion_steps, g.max_new_tokens) == (False, 1.3, 10, NEW_TOKENS)
    assert g.noise_scheduler_class == "DPMSolverMultistepScheduler"
    assert g.noise_scheduler_config == {"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}


def test_the_prompt_holds_one_placeholder_per_voice_frame(loaded):
    processor, _ = loaded
    voice = _voice(seconds=1.5)
    inputs = _inputs(processor, voice=voice)
    text = processor.apply_chat_template([{"role": "0", "content": [{"type": "text", "text": TEXT},
                                                                    {"type": "audio", "audio": voice}]}])
    assert f"Speaker 0: {TEXT}\n" in text and text.endswith(" Speech output:\n" + AUDIO_BOS)
    ids = inputs["input_ids"][0].tolist()
    frames = math.ceil(voice.size / HOP_LENGTH)
    assert ids.count(processor.audio_token_id) == frames == 12
    assert ids[-1] == processor.audio_bos_token_id
    assert inputs["input_values"].shape == (1, 1, frames * HOP_LENGTH)
    assert int(inputs["padding_mask"].sum()) == voice.size


def test_generate_clones_the_voice_deterministically(loaded):
    processor, model = loaded
    inputs = _inputs(processor)
    audio, latents, sequences = _generate(model, inputs)
    assert audio.shape == (1, NEW_TOKENS * HOP_LENGTH) and torch.isfinite(audio).all()
    assert 1e-3 < audio.pow(2).mean().sqrt() < 1 and latents.shape == (NEW_TOKENS, 64)
    # the tiny LM always emits the speech token (one diffusion step and one 3200-sample chunk each)
    assert sequences[0, -NEW_TOKENS:].tolist() == [processor.audio_token_id] * NEW_TOKENS
    again, again_latents, _ = _generate(model, inputs)
    assert torch.equal(audio, again) and torch.equal(latents, again_latents)
    # random tiny weights still listen to the script and the voice: far above float rounding (~1e-6)
    _, other_text, _ = _generate(model, _inputs(processor, text="The cat sat by the river."))
    assert (latents - other_text).abs().max() > 0.1
    _, other_voice, _ = _generate(model, _inputs(processor, voice=_voice(seed=1, hz=330.0)))
    assert (latents - other_voice).abs().max() > 0.1
    _, other_seed, _ = _generate(model, inputs, seed=1)
    assert (latents - other_seed).abs().max() > 1.0


def test_the_acoustic_decoder_streams_exactly(loaded):
    """Decoding generate's latents one frame at a time through the padding cache (what a separate decoder stage
    does) gives generate's audio bit for bit; longer chunks match the one-shot decode up to float rounding."""
    processor, model = loaded
    audio, latents, _ = _generate(model, _inputs(processor))
    tower, m = model.model.audio_tower, model.model
    scaled = (latents / m.latent_scaling_factor - m.latent_bias_factor).unsqueeze(0)  # (1, frames, 64)
    with torch.no_grad():
        whole = tower.decode(scaled).audio[0]
        for chunk in (1, 3):
            cache, parts = None, []
            for i in range(0, NEW_TOKENS, chunk):
                out = tower.decode(scaled[:, i:i + chunk], padding_cache=cache, use_cache=True)
                cache = out.padding_cache
                parts.append(out.audio[0])
            streamed = torch.cat(parts, dim=-1)
            if chunk == 1:
                assert torch.equal(streamed, audio)
            assert torch.allclose(streamed, whole, atol=1e-5), chunk


def test_rewrite_is_byte_identical(vibevoice_tiny_dir, tmp_path):
    again = make_checkpoint(str(tmp_path / "again"), "tiny", seed=0)
    first, second = _safetensors(vibevoice_tiny_dir), _safetensors(again)
    assert sorted(first) == ["model.safetensors"]
    assert first == second
