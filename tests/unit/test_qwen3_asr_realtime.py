"""A realtime transcription session on the Qwen3-ASR graph in one process (``LocalGraph``, no Ray), driven through
an in-memory WebSocket: every event parses as the official client's; a committed turn's transcript equals the
transcription route's on the same audio (itself held to ``generate``), and its deltas join to it; server VAD cuts
spoken turns and transcribes each; conversation events and bad settings get error events on a connection that stays
open."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import soundfile as sf

from omni_serve.bench.realtime import speechlike
from omni_serve.graph.frontend import RequestContext
from tests.asr_cases import ARGS
from tests.unit.test_realtime_session import FakeWebSocket, _conforms

PCM = (np.sin(2 * np.pi * 220 * np.arange(int(1.8 * 24000)) / 24000) * 9000).astype("<i2").tobytes()


@pytest.fixture(scope="module")
def graph(qwen3_asr_tiny_dir):
    from omni_serve.families.qwen3_asr import FAMILY
    from omni_serve.graph.local import LocalGraph

    g = LocalGraph(FAMILY, {"checkpoint": qwen3_asr_tiny_dir, **ARGS})
    yield g
    asyncio.run(g.aclose())


def _b64(pcm: bytes) -> str:
    return base64.b64encode(pcm).decode()


async def _session(graph, query=None):
    ws = FakeWebSocket(query if query is not None else {"intent": "transcription"})
    task = asyncio.create_task(graph.frontend.realtime_session(ws, RequestContext(60)))
    created = await ws.until("session.created")
    return ws, task, created[-1]


async def _close(ws, task):
    ws.inbox.put_nowait({"type": "websocket.disconnect"})
    await asyncio.wait_for(task, 30)


async def _route_transcript(graph, pcm: bytes, language: str | None) -> str:
    """The transcription route's text for the audio the session transcribes (the same 16 kHz samples)."""
    from omni_serve.api.audio_protocol import TranscriptionRequest
    from omni_serve.families.qwen3_asr.realtime import _resampled
    from starlette.datastructures import UploadFile

    buf = io.BytesIO()
    sf.write(buf, _resampled(pcm, 16000), 16000, format="WAV", subtype="FLOAT")
    req = TranscriptionRequest(file=UploadFile(file=io.BytesIO(buf.getvalue()), filename="a.wav"),
                               model="qwen3-asr", language=language)
    return (await graph.frontend.audio_transcriptions(req, RequestContext(60))).text


def test_a_committed_turn_equals_the_route_and_streams_its_text(graph):
    async def main():
        ws, task, created = await _session(graph)
        assert created["session"]["type"] == "transcription"
        assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        ws.send({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "turn_detection": None, "transcription": {"language": "en", "model": "qwen3-asr"}}}}})
        updated = await ws.until("session.updated")
        assert updated[-1]["session"]["audio"]["input"]["transcription"]["language"] == "en"
        for i in range(0, len(PCM), 9600):
            ws.send({"type": "input_audio_buffer.append", "audio": _b64(PCM[i:i + 9600])})
        ws.send({"type": "input_audio_buffer.commit"})
        events = await ws.until("conversation.item.input_audio_transcription.completed")
        await _close(ws, task)
        return [created] + updated + events, await _route_transcript(graph, PCM, "en")

    events, want = asyncio.run(main())
    _conforms(events)
    kinds = [e["type"] for e in events]
    assert kinds[2:5] == ["input_audio_buffer.committed", "conversation.item.added", "conversation.item.done"]
    item = events[2]["item_id"]
    deltas = [e for e in events if e["type"].endswith("transcription.delta")]
    done = events[-1]
    assert done["item_id"] == item and all(d["item_id"] == item for d in deltas) and deltas
    assert done["transcript"] == want and "".join(d["delta"] for d in deltas) == want
    assert done["usage"]["type"] == "tokens" and done["usage"]["output_tokens"] > 0


def test_server_vad_cuts_and_transcribes_each_spoken_turn(graph):
    async def main():
        ws, task, _ = await _session(graph, {})
        pcm = bytes(24000) + speechlike(1.2) + bytes(48000) + speechlike(0.9, seed=5) + bytes(48000)
        for i in range(0, len(pcm), 4800):
            ws.send({"type": "input_audio_buffer.append", "audio": _b64(pcm[i:i + 4800])})
        events = []
        while sum(e["type"].endswith("transcription.completed") for e in events) < 2:
            events += await ws.until("conversation.item.input_audio_transcription.completed")
        await _close(ws, task)
        return events

    events = asyncio.run(main())
    _conforms(events)
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    committed = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e["item_id"] for e in events if e["type"].endswith("transcription.completed")]
    assert len(started) == 2 and committed == [s["item_id"] for s in started] and sorted(completed) == sorted(committed)


@pytest.mark.parametrize("event, code, param", [
    ({"type": "response.create"}, "invalid_event_type", "type"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "hi"}]}},
     "invalid_event_type", "type"),
    ({"type": "session.update", "session": {"type": "realtime"}}, "invalid_value", "session.type"),
    ({"type": "session.update", "session": {"audio": {"input": {"transcription": {"language": "klingon"}}}}},
     "invalid_value", "session.audio.input.transcription.language"),
    ({"type": "session.update", "session": {"audio": {"input": {"transcription": {"model": "whisper-1"}}}}},
     "model_not_found", "session.audio.input.transcription.model"),
    ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", None),
])
def test_bad_events_get_an_error_and_the_session_goes_on(graph, event, code, param):
    async def main():
        ws, task, _ = await _session(graph)
        ws.send(event)
        error = (await ws.until("error"))[-1]
        ws.send({"type": "input_audio_buffer.clear"})
        cleared = await ws.until("input_audio_buffer.cleared")  # still open
        await _close(ws, task)
        return error, cleared

    error, cleared = asyncio.run(main())
    assert error["error"]["code"] == code and error["error"].get("param") == param, error
    assert cleared[-1]["type"] == "input_audio_buffer.cleared"


def test_another_intent_or_model_is_refused(graph):
    async def main(query):
        ws = FakeWebSocket(query)
        await asyncio.wait_for(graph.frontend.realtime_session(ws, RequestContext(60)), 30)
        return ws.events.get_nowait(), ws.closed

    for query in ({"intent": "conversation"}, {"model": "gpt-4o-transcribe"}):
        error, closed = asyncio.run(main(query))
        assert error["type"] == "error" and closed[0] == 1008
