"""The Qwen3-Omni stages on their real engines, wired in-process, reproduce transformers' generate exactly.

No Ray: engines, programs and models as served (``tests/qwen3_inprocess.py``). Held to
``Qwen3OmniMoeForConditionalGeneration.generate`` (greedy) on the same tiny checkpoint: the text tokens, every
codebook of every codec frame, and the waveform, for text, audio and image prompts (with a system turn, which the
talker must leave out) and video prompts (heard with and without their sound track), in both thinker layouts, 8
requests in flight, and under KV-cache pressure (preemption). The reference's inputs come from transformers' own
processor; the served ones from ours (``tests/unit/test_omni_inputs.py`` holds them equal).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_serve.engines.ar import ARConfig
from omni_serve.families.qwen3_omni.replica.code2wav import Code2WavCompute, Code2WavRequest, Code2WavStream
from omni_serve.families.qwen3_omni.messages import CodecChunk
from omni_serve.models.qwen3_omni import Qwen3OmniCode2Wav
from omni_serve.models.qwen3_omni_vocoder import VocoderStream
from tests.omni_cases import ALL_CASES, CASES, VIDEO_CASES, reference_inputs, serve_inputs
from tests.qwen3_inprocess import InProcessQwen3Omni, input_processor, reference

THINKER_TOKENS, TALKER_TOKENS = 12, 24
SYSTEM = {"role": "system", "content": [{"type": "text", "text": "answer briefly"}]}


@pytest.fixture(scope="module")
def ref_model(qwen3_omni_tiny_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_tiny_dir).eval()


@pytest.fixture(scope="module")
def references(ref_model, qwen3_omni_tiny_dir):
    """Per case: the served inputs (ours) and generate's output on transformers' processor's inputs."""
    proc = input_processor(qwen3_omni_tiny_dir)
    inputs = {kind: serve_inputs(proc, kind, prefix=(SYSTEM,)) for kind in ALL_CASES}
    return inputs, {kind: reference(ref_model, reference_inputs(qwen3_omni_tiny_dir, kind, prefix=(SYSTEM,)),
                                    THINKER_TOKENS, TALKER_TOKENS) for kind in ALL_CASES}


def check(got, want):
    assert got.tokens == want.tokens
    assert got.frames == want.frames
    assert got.wav is not None and got.wav.shape == want.wav.shape
    # random weights make the speech quiet: the tolerance is relative to its peak
    np.testing.assert_allclose(got.wav, want.wav, rtol=0, atol=1e-5 * np.abs(want.wav).max())


async def _serve(checkpoint, jobs, ar=None, layout="aggregated", talker_tokens=TALKER_TOKENS,
                 thinker_tokens=THINKER_TOKENS):
    omni = InProcessQwen3Omni(checkpoint, ar, talker_tokens=talker_tokens, thinker_layout=layout)
    try:
        results = await asyncio.gather(*(omni.run(f"r{i}", x, thinker_tokens) for i, x in enumerate(jobs)))
        engines = [e.stats() for e in (omni.thinker, omni.talker, omni.thinker_prefill) if e is not None]
    finally:
        await omni.close()
    return results, engines


@pytest.mark.parametrize("layout", ("aggregated", "disaggregated"))
@pytest.mark.parametrize("kind", ALL_CASES)
def test_stages_match_transformers_generate(references, qwen3_omni_tiny_dir, kind, layout):
    inputs, refs = references
    assert len(refs[kind].frames) > 0 and len(refs[kind].frames[0]) == 4  # speech with every codebook
    (got,), _ = asyncio.run(_serve(qwen3_omni_tiny_dir, [inputs[kind]], layout=layout))
    check(got, refs[kind])


def test_prompts_differ_so_outputs_differ(references):
    """Negative control: the oracle can fail (each prompt's reference differs from the others': every codec frame
    list, and the text except between the two video cases, whose tiny thinker says the same with or without the
    sound track; its states, which the talker reads, differ)."""
    _, refs = references
    for a in ALL_CASES:
        for b in ALL_CASES:
            if a != b:
                assert refs[a].frames != refs[b].frames, (a, b)
                if not {a, b} <= set(VIDEO_CASES):
                    assert refs[a].tokens != refs[b].tokens, (a, b)


def test_eight_in_flight_batch_the_talker_and_its_code_predictor(references, qwen3_omni_tiny_dir):
    inputs, refs = references
    kinds = [ALL_CASES[i % len(ALL_CASES)] for i in range(8)]
    results, (thinker, talker) = asyncio.run(_serve(qwen3_omni_tiny_dir, [inputs[k] for k in kinds]))
    for kind, got in zip(kinds, results):
        check(got, refs[kind])
    assert thinker["batched_rows"] > thinker["steps"], "thinker requests were never batched together"
    assert talker["followups"] > talker["followup_calls"], "code predictor frames were never batched"
    assert talker["kv_blocks_used"] == thinker["kv_blocks_used"] == 0


@pytest.mark.parametrize("layout", ("aggregated", "disaggregated"))
def test_kv_pressure_preempts_without_loss(references, qwen3_omni_tiny_dir, layout):
    inputs, refs = references
    kinds = [CASES[i % len(CASES)] for i in range(8)]
    ar = ARConfig(num_kv_blocks=24, block_size=4, max_batch_tokens=32)
    results, engines = asyncio.run(_serve(qwen3_omni_tiny_dir, [inputs[k] for k in kinds], ar=ar, layout=layout))
    for kind, got in zip(kinds, results):
        check(got, refs[kind])
    assert engines[0]["preemptions"] + engines[1]["preemptions"] > 0
    for stats in engines:
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == ar.num_kv_blocks


def test_video_prompts_under_kv_pressure_preempt_without_loss(references, qwen3_omni_tiny_dir):
    """Video prompts (hundreds of rows) beside the other kinds in a cache that holds about one of them."""
    inputs, refs = references
    kinds = [ALL_CASES[(i + 3) % len(ALL_CASES)] for i in range(8)]
    ar = ARConfig(num_kv_blocks=100, block_size=4, max_batch_tokens=64)
    longest = max(inputs[k].input_ids.shape[1] for k in kinds) + THINKER_TOKENS + 2
    assert longest < ar.num_kv_blocks * ar.block_size < 2 * longest  # one fits, two of the largest do not
    results, engines = asyncio.run(_serve(qwen3_omni_tiny_dir, [inputs[k] for k in kinds], ar=ar))
    for kind, got in zip(kinds, results):
        check(got, refs[kind])
    assert engines[0]["preemptions"] + engines[1]["preemptions"] > 0
    for stats in engines:
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == ar.num_kv_blocks


def test_long_speech_crosses_a_code2wav_block(ref_model, references, qwen3_omni_tiny_dir):
    """More than 300 frames: generate decodes them in two blocks (chunked_decode); the stream does the same."""
    inputs, _ = references
    want = reference(ref_model, inputs["text"], THINKER_TOKENS, 330)
    assert len(want.frames) > 300
    (got,), _ = asyncio.run(_serve(qwen3_omni_tiny_dir, [inputs["text"]], talker_tokens=330))
    check(got, want)


def test_a_one_token_reply_gives_its_text_and_empty_audio(references, qwen3_omni_tiny_dir):
    inputs, _ = references
    (got,), (thinker, talker) = asyncio.run(_serve(qwen3_omni_tiny_dir, [inputs["text"]], thinker_tokens=1))
    assert len(got.tokens) == 1 and got.frames == []
    assert got.wav is not None and got.wav.shape == (0,)
    assert talker["steps"] == 0 and talker["kv_blocks_used"] == thinker["kv_blocks_used"] == 0


# -- code2wav streaming on its own ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def code2wav(qwen3_omni_tiny_dir):
    return Qwen3OmniCode2Wav(qwen3_omni_tiny_dir)


def stream(model, frames, req, feed=37):
    """Feed ``frames`` in pieces of ``feed``; run every ready chunk through the engine's compute."""
    program, compute, out = Code2WavStream(model, req), Code2WavCompute(model), []
    for i in range(0, len(frames), feed):
        program.feed(CodecChunk(frames=frames[i:i + feed], end=i + feed >= len(frames)))
        while program.ready():
            _, job = program.work()
            out += program.complete(compute([job])[0])
    assert program.done
    return np.concatenate([c.audio for c in out]), [c.num_codes for c in out]


@pytest.mark.parametrize("n", (3, 90, 650))
def test_code2wav_stream_equals_chunked_decode(code2wav, n):
    frames = torch.randint(0, 2048, (n, code2wav.num_quantizers), generator=torch.Generator().manual_seed(n))
    want = code2wav.reference(frames.T).numpy()
    got, sizes = stream(code2wav, frames.tolist(), Code2WavRequest())
    assert sum(sizes) == n and (n < 5 or sizes[:4] == [2, 6, 24, 25])  # chunks grow
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_code2wav_stream_without_its_state_breaks_the_seams(code2wav, monkeypatch):
    """Negative control: chunks decoded each from a fresh stream (no left context, no attention cache) do not
    equal the whole decode."""
    frames = torch.randint(0, 2048, (90, code2wav.num_quantizers), generator=torch.Generator().manual_seed(5))
    want = code2wav.reference(frames.T).numpy()
    monkeypatch.setattr(code2wav, "feed", lambda s, codes: code2wav.streaming.feed(VocoderStream(), codes))
    got, _ = stream(code2wav, frames.tolist(), Code2WavRequest())
    assert got.shape != want.shape or np.abs(got - want).max() > 1e-3 * np.abs(want).max()


class _Pace:
    """A client ``slack`` seconds from running dry; counts the audio sent."""

    def __init__(self, slack: float):
        self.slack_s, self.audio_s = slack, 0.0

    def slack(self) -> float:
        return self.slack_s

    def due(self) -> float:
        return self.slack_s

    def sent(self, seconds: float) -> None:
        self.audio_s += seconds


def test_a_chunk_goes_with_the_frames_here_when_its_client_is_about_to_run_dry(code2wav):
    """After a 2-frame first chunk the next is 6 frames; with 4 here it waits while the client has a lead, goes
    with the 4 once the client is within cut_lead_s of running dry, and waits again for its whole chunk once the
    client is dry. The cut chunks still concatenate to the whole decode."""
    frames = torch.randint(0, 2048, (40, code2wav.num_quantizers), generator=torch.Generator().manual_seed(3)).tolist()
    program, compute = Code2WavStream(code2wav, Code2WavRequest(cut_lead_s=0.4)), Code2WavCompute(code2wav)
    program.pace = pace = _Pace(0.66)
    program.feed(CodecChunk(frames=frames[:2], end=False))
    out = program.complete(compute([program.work()[1]])[0])
    program.feed(CodecChunk(frames=frames[2:6], end=False))
    assert not program.ready()  # 0.66 s of lead: the 6-frame chunk waits for its frames
    pace.slack_s = -0.1
    assert not program.ready()  # dry already: a cut buys it little, the whole chunk goes
    pace.slack_s = 0.3
    assert program.ready() and program.work_size() == 4
    pace.slack_s = -0.05  # the client ran dry between the engine's choice and the call: the chunk stays cut
    out += program.complete(compute([program.work()[1]])[0])
    assert [c.num_codes for c in out] == [2, 4]
    rest = 6
    for i in range(rest, len(frames), 5):  # the rest in pieces (the client dry: whole chunks, then the end)
        program.feed(CodecChunk(frames=frames[i:i + 5], end=i + 5 >= len(frames)))
        while program.ready():
            out += program.complete(compute([program.work()[1]])[0])
    assert program.done and pace.audio_s > 0
    want = code2wav.reference(torch.tensor(frames).T).numpy()
    got = np.concatenate([c.audio for c in out])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
