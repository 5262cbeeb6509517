"""The Qwen3-ASR checkpoint writer: what it writes loads strictly into transformers'
``Qwen3ASRForConditionalGeneration`` (and ``AutoModel``) and ``AutoProcessor`` (``Qwen3ASRProcessor``), offline, and
transcribes synthetic audio with greedy ``generate``: reproducibly, reacting to its audio (another clip -> other logits
and tokens), batched as alone, and the split recipe a served graph uses (encoder -> audio embeddings scattered into
the prompt's placeholders -> the LLM on ``inputs_embeds`` with a KV cache) gives ``generate``'s tokens. The same size
and seed write byte-identical weights.

Padding caveat (batched vs alone): the feature extractor pads a batch's waveforms to the longest clip, so a shorter
clip's last STFT frame sees zeros where the clip alone sees its reflection, and its padded mel frames hold the log-mel
of silence where alone they are the zeros ``np.pad`` adds; the encoder's stride-2 convolutions read one frame past a
partial chunk's end, so the clip's last audio embedding moves (~1e-3), and through the encoder's attention the
others (~1e-6): its logits differ by a few 1e-2. Greedy tokens agree here; floats do not. The LLM side and the
encoder batch exactly: the clip's own (alone) log-mel in the batch gives its alone logits. (A clip whose length is
not a multiple of the 160-sample hop also gets one more mel frame in a batch than alone, which can add an audio
token; the clips here are whole hops.)
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from omni_serve.checkpoints import qwen3_asr as Q
from tests.unit.test_qwen_image_checkpoint import _safetensors

SR = 16000
NEW = 16


def clip(seconds: float, freq: float, seed: int) -> np.ndarray:
    """A seeded 16 kHz clip: two tones and a little noise."""
    t = np.arange(int(seconds * SR)) / SR
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.2 * np.sin(2 * np.pi * 3.7 * freq * t) + 0.05 * noise).astype(
        np.float32)


A, B = clip(2.0, 220.0, 0), clip(1.3, 660.0, 1)


@pytest.fixture(scope="module")
def processor(qwen3_asr_tiny_dir):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(qwen3_asr_tiny_dir)


@pytest.fixture(scope="module")
def model(qwen3_asr_tiny_dir):
    from transformers import Qwen3ASRForConditionalGeneration

    m, info = Qwen3ASRForConditionalGeneration.from_pretrained(qwen3_asr_tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return m.eval()


def _generate(model, inputs) -> list[list[int]]:
    """Greedy, exactly ``NEW`` new tokens (eos suppressed until then) per row."""
    out = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return out[:, inputs["input_ids"].shape[1]:].tolist()


def test_layout_configs_and_processor(qwen3_asr_tiny_dir, processor, model):
    from transformers import AutoModel, Qwen3ASRFeatureExtractor, Qwen3ASRModel, Qwen3ASRProcessor

    with open(os.path.join(qwen3_asr_tiny_dir, "omni_serve_checkpoint.json")) as f:
        assert json.load(f) == {"family": "qwen3_asr", "size": "tiny", "seed": 0}
    assert isinstance(processor, Qwen3ASRProcessor)
    fe = processor.feature_extractor
    assert isinstance(fe, Qwen3ASRFeatureExtractor)
    assert {k: getattr(fe, k) for k in Q.FEATURES} == Q.FEATURES
    tok, cfg = processor.tokenizer, model.config
    assert sum(p.numel() for p in model.parameters()) < 500_000
    # the config's ids are our tokenizer's tokens
    assert cfg.audio_token_id == processor.audio_token_id == tok.convert_tokens_to_ids("<|audio_pad|>")
    assert cfg.timestamp_token_id == tok.convert_tokens_to_ids("<timestamp>")
    assert set(cfg.eos_token_id) == {tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    assert cfg.pad_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert cfg.text_config.vocab_size == len(tok) and cfg.audio_config.output_dim == cfg.text_config.hidden_size
    assert cfg.audio_config.num_mel_bins == fe.feature_size and cfg.audio_config.n_window == fe.n_window
    # the headless model loads from the same files
    base, info = AutoModel.from_pretrained(qwen3_asr_tiny_dir, output_loading_info=True)
    assert isinstance(base, Qwen3ASRModel) and not info["missing_keys"] and not info["unexpected_keys"], info
    # the prompt the processor builds for a transcription: an empty system turn, the forced language prefilled
    prompt = processor.apply_transcription_request(A, language="en", tokenize=False)[0]
    assert prompt == ("<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|audio_start|><|audio_pad|><|audio_end|>"
                      "<|im_end|>\n<|im_start|>assistant\nlanguage English<asr_text>")
    plain = processor.apply_transcription_request(A, prompt="hotwords", tokenize=False)[0]
    assert plain.startswith("<|im_start|>system\nhotwords<|im_end|>\n") and plain.endswith("<|im_start|>assistant\n")
    # one <|audio_pad|> per audio token: 13 per second (a 100-frame chunk), fewer for a partial one
    inputs = processor.apply_transcription_request([A, B], language="English")
    n_audio = (inputs["input_ids"] == cfg.audio_token_id).sum(-1).tolist()
    assert n_audio == [26, 17]
    assert inputs["input_features"].shape == (2, 128, 200) and inputs["input_features_mask"].sum(-1).tolist() == [
        200, 130]
    # <asr_text> is not special: the parsed decode finds it
    text = tok.decode(tok("language English<asr_text>red cat")["input_ids"], skip_special_tokens=True)
    assert processor.parse_output(text) == {"language": "English", "transcription": "red cat"}


def test_generate_is_deterministic_and_reacts_to_its_audio(processor, model):
    a = processor.apply_transcription_request(A, language="English")
    b = processor.apply_transcription_request(B, language="English")
    first = _generate(model, a)
    assert first == _generate(model, a)
    assert len(first[0]) == NEW and len(set(first[0])) > 1  # not one token repeated
    assert first != _generate(model, b)
    with torch.no_grad():
        la, lb = model(**a).logits[0, -1], model(**b).logits[0, -1]
        again = model(**a).logits[0, -1]
    assert torch.equal(la, again)
    assert (la - lb).abs().max() > 0.5  # logits' std is ~1.3: the audio moves them, not rounding
    # the audio, not only the prompt length: the same prompt with another clip of the same length
    c = processor.apply_transcription_request(clip(2.0, 440.0, 2), language="English")
    assert torch.equal(c["input_ids"], a["input_ids"])
    with torch.no_grad():
        lc = model(**c).logits[0, -1]
    assert (la - lc).abs().max() > 0.5


def test_batched_generate_equals_each_alone(processor, model):
    alone = [processor.apply_transcription_request(x, language="English") for x in (A, B)]
    batch = processor.apply_transcription_request([A, B], language="English")
    assert batch["attention_mask"][1, 0] == 0  # left-padded prompt (B's has fewer audio tokens)
    assert _generate(model, batch) == [_generate(model, x)[0] for x in alone]
    with torch.no_grad():
        lb = model(**alone[1]).logits[0, -1]
        assert (lb - model(**batch).logits[1, -1]).abs().max() < 0.2  # close, not equal: the padding caveat
        # the caveat is the feature extraction's alone: B's own log-mel in the batch's layout (zero-padded to the
        # batch's frames, as the processor pads one clip) gives B's logits, left padding and all
        n = alone[1]["input_features"].shape[-1]
        assert torch.equal(alone[1]["input_features"][0, :, 130:], torch.zeros(128, n - 130))
        own = dict(batch, input_features=batch["input_features"].clone())
        own["input_features"][1] = 0.0
        own["input_features"][1, :, :n] = alone[1]["input_features"][0]
        assert torch.allclose(lb, model(**own).logits[1, -1], atol=1e-4)
        assert torch.allclose(model(**alone[0]).logits[0, -1], model(**batch).logits[0, -1], atol=1e-4)


def test_split_encoder_and_llm_reproduce_generate(processor, model):
    """What a two-stage graph runs: the encoder's output (``get_audio_features(...).pooler_output``, all clips'
    tokens flat) is scattered into the ``<|audio_pad|>`` rows of the prompt's embeddings; the LLM prefills on
    ``inputs_embeds`` (positions from the attention mask, as ``generate`` makes them) and decodes with a KV cache."""
    from transformers import DynamicCache

    batch = processor.apply_transcription_request([A, B], language="English")
    with torch.no_grad():
        audio = model.get_audio_features(batch["input_features"], batch["input_features_mask"]).pooler_output
        assert audio.shape == (26 + 17, model.config.text_config.hidden_size)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        embeds = model.get_input_embeddings()(ids)
        slots = (ids == model.config.audio_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(slots, audio.to(embeds.dtype))
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=model.config.text_config)
        logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True, logits_to_keep=1).logits[:, -1]
        tokens = []
        for _ in range(NEW):
            logits[:, list(model.generation_config.eos_token_id)] = -float("inf")  # as min_new_tokens does
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(nxt)
            mask = torch.cat([mask, torch.ones_like(nxt)], -1)
            pos = pos[:, -1:] + 1
            logits = model(input_ids=nxt, attention_mask=mask, position_ids=pos, past_key_values=cache,
                           use_cache=True).logits[:, -1]
    assert torch.cat(tokens, -1).tolist() == _generate(model, batch)


def test_same_size_and_seed_write_identical_weights(qwen3_asr_tiny_dir, tmp_path):
    first = _safetensors(qwen3_asr_tiny_dir)
    assert sorted(first) == ["model.safetensors"]
    assert _safetensors(Q.make_checkpoint(str(tmp_path / "again"), "tiny")) == first
    other = _safetensors(Q.make_checkpoint(str(tmp_path / "other"), "tiny", seed=1))
    assert other["model.safetensors"] != first["model.safetensors"]
