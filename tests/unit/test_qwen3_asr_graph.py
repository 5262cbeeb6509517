"""The Qwen3-ASR graph in one process (``LocalGraph``: the stages' runners and engines, the frontend, no Ray) on the
tiny checkpoint, against transformers' greedy ``generate`` on the same checkpoint, window by window.

- Oracle: every window's tokens equal ``generate``'s (the processor's prompt for that window alone), token for
  token, for clips transcribed alone and all at once (windows of several uploads batched on the encoder and
  decoding together on the LLM), long audio (several windows) included; negative control: another clip's tokens
  differ.
- The stream's deltas join to the reply's text; the LLM sends a streamed window's tokens first alone, then in
  groups of ``stream_interval``, and a window that does not stream in one message; ``text`` and ``verbose_json``
  carry the same transcript, the latter one segment per window at its place in the audio.
- Bad input is a 400 naming the field: unknown model, srt/vtt, unknown language, an empty or unreadable file.
- ``split_windows``: the cut lands in the quiet part; windows cover the audio and none is longer than the limit.
"""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from omni_serve.families.qwen3_asr.prompting import join, split_windows
from tests.asr_cases import ARGS, CLIPS, SR, Reference, tone, wav

def upload(data: bytes, name: str = "a.wav"):
    from starlette.datastructures import UploadFile

    return UploadFile(file=io.BytesIO(data), filename=name)


def request(data: bytes, **kw):
    from omni_serve.api.audio_protocol import TranscriptionRequest

    return TranscriptionRequest(file=upload(data), model=kw.pop("model", "qwen3-asr"), **kw)


@pytest.fixture(scope="module")
def reference(qwen3_asr_tiny_dir):
    return Reference(qwen3_asr_tiny_dir).tokens


def run(qwen3_asr_tiny_dir, coro_factory, **args):
    from omni_serve.families.qwen3_asr import FAMILY
    from omni_serve.graph.local import LocalGraph

    async def main():
        async with LocalGraph(FAMILY, {"checkpoint": qwen3_asr_tiny_dir, **ARGS, **args}) as graph:
            return await coro_factory(graph.frontend)

    return asyncio.run(main())


def ctx():
    from omni_serve.graph.frontend import RequestContext

    return RequestContext(timeout_s=300)


def test_windows_equal_generate_alone_and_batched(qwen3_asr_tiny_dir, reference):
    async def alone(frontend):
        return [await frontend.audio_transcriptions(request(wav(c), response_format="verbose_json"), ctx())
                for c in CLIPS]

    async def together(frontend):
        return await asyncio.gather(*(frontend.audio_transcriptions(
            request(wav(c), response_format="verbose_json", language="en" if i % 2 else None), ctx())
            for i, c in enumerate(CLIPS)))

    solo = run(qwen3_asr_tiny_dir, alone)
    batched = run(qwen3_asr_tiny_dir, together)
    assert len(solo[-1].segments) == 3  # 7.5 s in windows of at most 3 s
    for i, (clip, one, many) in enumerate(zip(CLIPS, solo, batched)):
        want = reference(clip)
        assert [s.tokens for s in one.segments] == want, f"clip {i} alone"
        assert [s.tokens for s in many.segments] == reference(clip, language="en" if i % 2 else None), f"clip {i}"
        assert one.duration == pytest.approx(clip.size / SR, abs=1e-3)
        assert one.segments[0].start == 0 and one.segments[-1].end == pytest.approx(clip.size / SR, abs=1e-3)
        assert one.text == join([s.text for s in one.segments])
        assert one.usage["output_tokens"] == sum(len(t) for t in want)
    # negative control: the model hears its audio (another clip, other tokens)
    assert reference(CLIPS[1]) != reference(CLIPS[0])
    assert [s.tokens for s in solo[0].segments] != reference(CLIPS[1])


def test_stream_text_and_json_agree(qwen3_asr_tiny_dir):
    clip = CLIPS[3]

    async def main(frontend):
        plain = await frontend.audio_transcriptions(request(wav(clip)), ctx())
        text = await frontend.audio_transcriptions(request(wav(clip), response_format="text"), ctx())
        stream = await frontend.audio_transcriptions(request(wav(clip), stream=True), ctx())
        lines = [line async for line in stream.lines]
        return plain, text, lines

    plain, text, lines = run(qwen3_asr_tiny_dir, main)
    events = [json.loads(line[len("data: "):]) for line in lines]
    assert [e["type"] for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    done = events[-1]
    assert done["type"] == "transcript.text.done" and done["text"] == plain.text == text.body
    assert "".join(e["delta"] for e in events[:-1]) == plain.text
    assert done["usage"]["output_tokens"] == plain.usage.output_tokens


@pytest.mark.parametrize("interval", [1, 3])
def test_streamed_tokens_go_first_alone_then_in_groups_and_otherwise_at_the_end(qwen3_asr_tiny_dir, reference,
                                                                                 interval):
    """``stages.llm.params.stream_interval``: a streamed window's first token comes alone, later ones in groups of the
    interval (the last group what is left); a window that does not stream comes in one message. The tokens are the
    same either way."""
    from omni_serve.families.qwen3_asr.messages import TranscriptTokens

    clip = CLIPS[3]

    async def main(frontend):
        got = {}
        for stream in (True, False):
            windows = frontend.windows_of(clip, None, None, f"interval-{stream}")
            got[stream] = [[] for _ in windows]
            async for i, out in frontend.window_outputs(windows, 0.0, 300, stream=stream):
                if isinstance(out, TranscriptTokens):
                    got[stream][i].append(out.token_ids)
        return got

    got = run(qwen3_asr_tiny_dir, main, **{"stages.llm.params.stream_interval": interval})
    want = reference(clip)
    assert len(want) == 3 and all(len(w) > 4 for w in want)
    for window, tokens in zip(got[True], want):
        assert sum(window, []) == tokens
        assert [len(m) for m in window[:-1]] == [1] + [interval] * (len(window) - 2)
        assert 1 <= len(window[-1]) <= interval
    assert got[False] == [[tokens] for tokens in want]


@pytest.mark.parametrize("kw, data, param", [
    ({"model": "whisper-1"}, None, "model"),
    ({"response_format": "srt"}, None, "response_format"),
    ({"language": "klingon"}, None, "language"),
    ({}, b"", "file"),
    ({}, b"not audio at all" * 10, "file"),
])
def test_bad_input_is_a_400_naming_the_field(qwen3_asr_tiny_dir, kw, data, param):
    from omni_serve.api.errors import OpenAIError

    async def main(frontend):
        with pytest.raises(OpenAIError) as err:
            await frontend.audio_transcriptions(request(wav(CLIPS[0]) if data is None else data, **kw), ctx())
        return err.value

    err = run(qwen3_asr_tiny_dir, main)
    assert err.status_code == 400 and err.param == param, (err.status_code, err.param, str(err))


def test_split_windows_cut_in_the_quiet():
    x = tone(10.0, 300.0, 5)
    x[int(2.2 * SR):int(2.5 * SR)] = 0.0  # a pause inside the search range of the first cut (2-3 s)
    windows = split_windows(x.size, SR, 3.0, 1.0, x)
    assert windows[0][0] == 0 and windows[-1][1] == x.size
    assert all(a == b for (_, a), (b, _) in zip(windows, windows[1:]))
    assert all(0 < b - a <= 3 * SR for a, b in windows)
    assert 2.2 * SR <= windows[0][1] <= 2.5 * SR
    assert split_windows(3 * SR, SR, 3.0, 1.0, tone(3.0, 300.0, 0)) == [(0, 3 * SR)]
    assert split_windows(7 * SR, SR, 3.0, 0.0) == [(0, 3 * SR), (3 * SR, 6 * SR), (6 * SR, 7 * SR)]
    assert join(["hello", "world", "", "你好", "x"]) == "hello world你好x"
