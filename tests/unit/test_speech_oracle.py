"""Speech (``/v1/audio/speech``'s path): a forced thinker reply, spoken by the served stages, equals transformers'
talker and token2wav driven with the same forced thinker states.

The reference is each family's own ``generate`` with its thinker's ``generate`` replaced by one forward over the
prompt and the forced reply (all but its last token, which generation never feeds back), returned in generate's
shape: step 0's hidden states cover the prompt, step k the k-th reply token. Everything after (the talker's
prompt, its greedy decoding, code2wav) is transformers' code. The served side runs the real runners and engines
in-process (``tests/omni_inprocess.py``, ``tests/qwen3_inprocess.py``) with ``ThinkerCall.forced_reply``.
Negative control: another text gives other codec tokens.
"""

from __future__ import annotations

import asyncio
import numpy as np
import pytest

from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from tests.omni_inprocess import InProcessOmni
from tests.speech_cases import qwen2_5_speech, qwen3_speech, speech_prompt
from tests.qwen3_inprocess import InProcessQwen3Omni

TEXTS = ("hello world cat", "the dog says good morning to the cat")
SEED, TALKER_TOKENS = 7, 24
SYSTEM = "You are a test assistant."


# -- Qwen2.5-Omni -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_5(omni_tiny_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_tiny_dir).eval(), OmniInputProcessor(omni_tiny_dir)


async def _qwen2_5_serve(checkpoint, jobs, layout="aggregated"):
    omni = InProcessOmni(checkpoint, steps=3, talker_tokens=TALKER_TOKENS, thinker_layout=layout)
    try:
        return await asyncio.gather(*(omni.run(f"s{i}", x, len(forced), SEED, forced_reply=forced)
                                      for i, (x, forced) in enumerate(jobs)))
    finally:
        await omni.close()


@pytest.mark.parametrize("layout", ("aggregated", "disaggregated"))
def test_qwen2_5_speech_equals_transformers_talker_on_forced_states(qwen2_5, omni_tiny_dir, layout):
    model, proc = qwen2_5
    jobs = [speech_prompt(proc, t, SYSTEM) for t in TEXTS]
    refs = [qwen2_5_speech(model, x, forced, TALKER_TOKENS, steps=3, seed=SEED) for x, forced in jobs]
    assert refs[0][0] != refs[1][0]  # negative control: another text is other speech
    got = asyncio.run(_qwen2_5_serve(omni_tiny_dir, jobs, layout))
    for (x, forced), result, (codes, wav) in zip(jobs, got, refs):
        assert result.tokens == forced  # the reply is the text, not sampled
        assert result.codes == codes and len(codes) > 0
        np.testing.assert_allclose(result.wav, wav, rtol=0, atol=1e-4 * np.abs(wav).max())


# -- Qwen3-Omni ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(qwen3_omni_tiny_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return (Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_tiny_dir).eval(),
            OmniInputProcessor(qwen3_omni_tiny_dir))


async def _qwen3_serve(checkpoint, jobs):
    omni = InProcessQwen3Omni(checkpoint, talker_tokens=TALKER_TOKENS)
    try:
        return await asyncio.gather(*(omni.run(f"s{i}", x, len(forced), forced_reply=forced)
                                      for i, (x, forced) in enumerate(jobs)))
    finally:
        await omni.close()


def test_qwen3_speech_equals_transformers_talker_on_forced_states(qwen3, qwen3_omni_tiny_dir):
    model, proc = qwen3
    jobs = [speech_prompt(proc, t, SYSTEM) for t in TEXTS]
    refs = [qwen3_speech(model, x, forced, TALKER_TOKENS) for x, forced in jobs]
    assert refs[0][0] != refs[1][0]  # negative control: another text is other speech
    got = asyncio.run(_qwen3_serve(qwen3_omni_tiny_dir, jobs))
    for (x, forced), result, (frames, wav) in zip(jobs, got, refs):
        assert result.tokens == forced
        assert result.frames == frames and len(frames) > 0
        np.testing.assert_allclose(result.wav, wav, rtol=0, atol=1e-5 * np.abs(wav).max())
