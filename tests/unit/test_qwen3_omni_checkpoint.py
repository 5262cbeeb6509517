"""The Qwen3-Omni checkpoint writer: what it writes loads strictly into transformers' model and speaks.

Text, audio and image prompts run through ``Qwen3OmniMoeForConditionalGeneration.generate`` with speech out
(the MoE thinker, the talker with its code predictor, the causal code2wav), reproducibly; prompts differ ->
outputs differ (the model reacts to its input, so later oracles built on it can fail).
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
import torch

from omni_serve.checkpoints import qwen3_omni as Q
from tests.omni_cases import audio_clip, image


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return Q.make_checkpoint(str(tmp_path_factory.mktemp("q3") / "tiny"), "tiny")


@pytest.fixture(scope="module")
def model(ckpt):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    m, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return m.eval()


def _inputs(ckpt: str, kind: str, text: str = "hello world cat"):
    from transformers import AutoImageProcessor, AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    tok = AutoTokenizer.from_pretrained(ckpt)
    parts, kw = [{"type": "text", "text": text}], {}
    if kind == "audio":
        parts.insert(0, {"type": "audio"})
        fe = WhisperFeatureExtractor.from_pretrained(ckpt)
        feats = fe([audio_clip()], sampling_rate=16000, return_attention_mask=True, return_tensors="pt")
        kw = {"input_features": feats["input_features"], "feature_attention_mask": feats["attention_mask"]}
        count = int(_get_feat_extract_output_lengths(feats["attention_mask"].sum(-1))[0])
        placeholder = "<|audio_pad|>"
    elif kind == "image":
        parts.insert(0, {"type": "image"})
        pix = AutoImageProcessor.from_pretrained(ckpt)(images=[image()], return_tensors="pt")
        kw = {"pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}
        count = int(pix["image_grid_thw"].prod(-1)[0]) // 4
        placeholder = "<|image_pad|>"
    msgs = [{"role": "system", "content": "You are a test assistant."}, {"role": "user", "content": parts}]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    if kind != "text":
        rendered = rendered.replace(placeholder, placeholder * count)
    ids = tok(rendered, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **kw}


def _speak(model, inputs, speaker="Chelsie"):
    torch.manual_seed(0)
    seq, wav = model.generate(**inputs, speaker=speaker, return_audio=True, thinker_max_new_tokens=10,
                              thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=16)
    seq = getattr(seq, "sequences", seq)
    return seq[0, inputs["input_ids"].shape[1]:].tolist(), wav.reshape(-1).numpy()


def test_checkpoint_is_deterministic_and_states_its_size(ckpt, tmp_path):
    again = Q.make_checkpoint(str(tmp_path / "again"), "tiny")

    def digest(d):
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    assert digest(again) == digest(ckpt)
    from safetensors.torch import load_file

    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    worst = max(float(w.float().abs().max()) for w in weights.values())
    assert worst < 100, f"a tensor holds {worst}: uninitialised memory written as weights"
    other = Q.make_checkpoint(str(tmp_path / "seed1"), "tiny", seed=1)
    assert digest(other) != digest(ckpt)
    with pytest.raises(ValueError, match="unknown size"):
        Q.make_checkpoint(str(tmp_path / "x"), "huge")


def test_architecture_is_the_real_one_at_a_small_scale(model):
    cfg = model.config
    text = cfg.thinker_config.text_config
    assert text.num_experts > text.num_experts_per_tok > 1  # a mixture of experts thinker
    assert text.hidden_size // text.num_attention_heads in (32, 64)  # vLLM CPU attention head sizes
    assert cfg.talker_config.num_code_groups == cfg.code2wav_config.num_quantizers > 1  # residual codebooks
    assert cfg.talker_config.text_config.shared_expert_intermediate_size > 0
    assert set(cfg.talker_config.speaker_id) == set(Q.VOICES)
    tok_ids = {cfg.im_start_token_id, cfg.user_token_id, cfg.assistant_token_id, cfg.system_token_id}
    assert len(tok_ids) == 4 and max(tok_ids) < text.vocab_size


@pytest.mark.parametrize("kind", ["text", "audio", "image"])
def test_generate_speaks_reproducibly_for_every_input_kind(ckpt, model, kind):
    inputs = _inputs(ckpt, kind)
    tokens, wav = _speak(model, inputs)
    assert len(tokens) == 10 and wav.size > 0 and np.isfinite(wav).all()
    tokens2, wav2 = _speak(model, inputs)
    assert tokens2 == tokens
    np.testing.assert_array_equal(wav2, wav)


def test_outputs_depend_on_the_prompt_and_the_voice(ckpt, model):
    tokens_a, wav_a = _speak(model, _inputs(ckpt, "text", "hello world cat"))
    tokens_b, _ = _speak(model, _inputs(ckpt, "text", "blue river moon"))
    assert tokens_a != tokens_b
    _, wav_ethan = _speak(model, _inputs(ckpt, "text", "hello world cat"), speaker="Ethan")
    assert wav_ethan.shape != wav_a.shape or not np.array_equal(wav_ethan, wav_a)
    with pytest.raises(NotImplementedError, match="Speaker"):
        _speak(model, _inputs(ckpt, "text"), speaker="Nobody")
