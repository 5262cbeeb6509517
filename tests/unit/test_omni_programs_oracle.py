"""Stage programs, wired in-process, reproduce transformers' Qwen2.5-Omni generate exactly (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_serve.checkpoints.qwen2_5_omni import TOKEN_ID
from omni_serve.engines.sampling import SamplingParams
from omni_serve.graphs.qwen2_5_omni.programs import (
    Code2WavProgram, Code2WavRequest, EncoderProgram, TalkerProgram, TalkerRequest, ThinkerProgram,
    ThinkerRequest,
)
from omni_serve.models.qwen2_5_omni import OmniCode2Wav, OmniEncoder, OmniTalker, OmniThinker
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from tests.omni_cases import CASES, template_messages

THINKER_TOKENS, TALKER_TOKENS, STEPS, SEED = 12, 20, 3, 7


@pytest.fixture(scope="module")
def models(omni_tiny_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    d = omni_tiny_dir
    ref = Qwen2_5OmniForConditionalGeneration.from_pretrained(d).eval()
    return ref, OmniInputProcessor(d), OmniEncoder(d), OmniThinker(d), OmniTalker(d), OmniCode2Wav(d)


def reference(ref, inputs):
    codes = []
    hook = ref.token2wav.register_forward_pre_hook(lambda m, a: codes.append(a[0][0].tolist()))
    try:
        torch.manual_seed(SEED)
        seq, wav = ref.generate(**inputs.reference_kwargs(), thinker_max_new_tokens=THINKER_TOKENS,
                                talker_max_new_tokens=TALKER_TOKENS, thinker_do_sample=False,
                                talker_do_sample=False, token2wav_num_steps=STEPS)
    finally:
        hook.remove()
    return seq[0, inputs.input_ids.shape[1]:].tolist(), codes[0], wav.numpy()


def drive(program, feed=()):
    for item in feed:
        program.feed(item)
    program.close_input()
    outs = []
    while not program.done:
        assert program.ready(), "program stalled with all its input delivered"
        outs += program.step()
    return outs


@pytest.mark.parametrize("kind", CASES)
def test_programs_match_transformers_generate(models, kind):
    ref, proc, enc, thk, tlk, c2w = models
    messages, audios, images = template_messages(kind)
    x = proc(messages, audios, images)
    ref_tokens, ref_codes, ref_wav = reference(ref, x)

    media = {}
    if audios or images:
        media = drive(EncoderProgram(enc), [{
            "input_features": x.input_features, "feature_attention_mask": x.feature_attention_mask,
            "pixel_values": x.pixel_values, "image_grid_thw": x.image_grid_thw}])[0]["downstream"]
    thinker = ThinkerProgram(thk, proc.tokenizer, ThinkerRequest(
        input_ids=x.input_ids[0].tolist(), max_new_tokens=THINKER_TOKENS,
        sampling=SamplingParams(temperature=0), stop_token_ids=(TOKEN_ID["<|im_end|>"],),
        image_grid_thw=None if x.image_grid_thw is None else x.image_grid_thw.tolist(),
        audio_seqlens=None if x.audio_seqlens is None else x.audio_seqlens.tolist(),
        expects_media=bool(media), talker_voice_token=TOKEN_ID["<|spk_chelsie|>"],
        talker_tokens=(tlk.config.tts_text_end_token_id, tlk.config.tts_text_pad_token_id),
        media_token_ids=(TOKEN_ID["<|AUDIO|>"], TOKEN_ID["<|IMAGE|>"], TOKEN_ID["<|VIDEO|>"])))
    if media:
        thinker.feed(media)
    t_out = drive(thinker)
    tokens = [t for o in t_out for t in o["token_ids"]]
    talker = TalkerProgram(tlk, TalkerRequest(max_new_tokens=TALKER_TOKENS, sampling=SamplingParams(
        temperature=0, repetition_penalty=1.05, suppress_tokens=(tlk.codec_bos,))))
    k_out = drive(talker, [o["downstream"] for o in t_out if "downstream" in o])
    codes = [c for o in k_out for c in o["codes"]]
    wav = drive(Code2WavProgram(c2w, Code2WavRequest("Chelsie", SEED, STEPS)),
                [o["downstream"] for o in k_out])[0]["audio"]

    assert tokens == ref_tokens
    assert codes == ref_codes
    assert wav.shape == ref_wav.shape == (len(codes) * c2w.samples_per_code,)
    np.testing.assert_allclose(wav, ref_wav, atol=1e-5)


def test_each_adapter_holds_only_its_component(models):
    _, _, enc, thk, tlk, c2w = models
    def names(adapter):
        return {n for m in adapter.modules.values() for n, _ in m.named_parameters()}
    assert not any("audio" in n or "visual" in n or "blocks" in n for n in names(thk))
    assert all(n.startswith(("model.", "thinker_to_talker_proj", "codec_head")) for n in names(tlk))
    assert any(n.startswith("code2wav_dit_model") for n in names(c2w))
    total = sum(p.numel() for a in (enc, thk, tlk, c2w) for m in a.modules.values() for p in m.parameters())
    ref = models[0]
    assert total == sum(p.numel() for p in ref.parameters())
