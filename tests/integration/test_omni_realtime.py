"""``/v1/realtime`` on the served Qwen2.5-Omni graph (Ray Serve's proxy carries the WebSocket) through the official
``openai`` client: a two-turn spoken conversation with server VAD whose text and audio equal the non-streamed chat
replies to the same history, a forced tool call's round trip, bad events on the wire (error events, the connection
kept), a session cap, and nothing left in any stage afterwards."""

from __future__ import annotations

import base64
import json

import pytest

from omni_serve.bench.realtime import speechlike
from tests.integration.http_waits import busy_stages

pytestmark = pytest.mark.integration
MODEL = "qwen2.5-omni"
SEED = 11
CHUNK = 4800  # bytes per append: 100 ms of pcm16 at 24 kHz


@pytest.fixture(scope="module")
def client(omni_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{omni_app}/v1", api_key="unused")


def _until(conn, kind: str) -> list[dict]:
    out = []
    for event in conn:
        out.append(event.model_dump(exclude_none=True))
        if event.type == kind:
            return out
    raise AssertionError(f"the connection ended before {kind}")


def _speak(conn, pcm: bytes) -> None:
    for i in range(0, len(pcm), CHUNK):
        conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i:i + CHUNK]).decode())


def _turn_audio(pcm: bytes, events: list[dict], prefix_ms: int = 300) -> bytes:
    """The audio the server committed for a turn (from prefix_padding_ms before VAD's start to its stop)."""
    started = next(e for e in events if e["type"] == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e["type"] == "input_audio_buffer.speech_stopped")
    return pcm[max(0, started["audio_start_ms"] - prefix_ms) * 48:stopped["audio_end_ms"] * 48]


def test_a_spoken_two_turn_conversation_equals_the_chat_replies(client):
    """Turn after turn, the transcript deltas and audio deltas concatenate to the non-streamed chat reply (greedy, the
    same seed) to the same history: the user's committed audio and the assistant's previous answer."""
    utterance = bytes(12000) + speechlike(1.5) + bytes(48000)  # 0.25 s silence, speech, 1 s silence
    history, replies = [], []
    with client.realtime.connect(model=MODEL) as conn:
        assert _until(conn, "session.created")[-1]["session"]["audio"]["input"]["turn_detection"]["type"] == \
            "server_vad"
        conn.session.update(session={"type": "realtime", "temperature": 0, "seed": SEED, "max_output_tokens": 16,
                                     "audio": {"input": {"turn_detection": {"type": "server_vad",
                                                                            "silence_duration_ms": 300}}}})
        _until(conn, "session.updated")
        timeline = b""
        for _ in range(2):
            timeline += utterance
            _speak(conn, utterance)
            events = _until(conn, "response.done")
            kinds = [e["type"] for e in events]
            assert kinds.index("input_audio_buffer.speech_started") < kinds.index("input_audio_buffer.committed") \
                < kinds.index("response.created") < kinds.index("response.output_audio.delta")
            heard = _turn_audio(timeline, events)
            transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
            audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
            history.append({"role": "user", "content": [{"type": "input_audio", "input_audio": {
                "data": base64.b64encode(heard).decode(), "format": "pcm16"}}]})
            chat = client.chat.completions.create(model=MODEL, messages=history, temperature=0, seed=SEED,
                                                  max_tokens=16, modalities=["text", "audio"],
                                                  audio={"voice": "Chelsie", "format": "pcm16"})
            reply = chat.choices[0].message.audio
            assert transcript == reply.transcript and transcript
            assert audio == base64.b64decode(reply.data)
            assert events[-1]["response"]["usage"]["input_tokens"] == chat.usage.prompt_tokens
            history.append({"role": "assistant", "content": transcript})
            replies.append(transcript)
    assert len(replies) == 2


def test_a_forced_tool_call_round_trips_over_the_socket(client):
    """A named tool_choice: the response is one function_call item; its output sent back, the next response
    answers in text. Both through the official client's typed events."""
    tool = {"type": "function", "name": "get_weather", "description": "The weather.", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}
    with client.realtime.connect(model=MODEL) as conn:
        _until(conn, "session.created")
        conn.session.update(session={"type": "realtime", "tools": [tool], "temperature": 0,
                                     "output_modalities": ["text"], "audio": {"input": {"turn_detection": None}}})
        _until(conn, "session.updated")
        conn.conversation.item.create(item={"type": "message", "role": "user",
                                            "content": [{"type": "input_text", "text": "Weather in Paris?"}]})
        _until(conn, "conversation.item.done")
        conn.response.create(response={"tool_choice": {"type": "function", "name": "get_weather"},
                                       "max_output_tokens": 160})
        events = _until(conn, "response.done")
        (call,) = events[-1]["response"]["output"]
        assert call["type"] == "function_call" and call["name"] == "get_weather"
        assert json.loads(call["arguments"])["city"] in ("Paris", "Rome")
        done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
        assert done["arguments"] == call["arguments"] and done["call_id"] == call["call_id"]
        conn.conversation.item.create(item={"type": "function_call_output", "call_id": call["call_id"],
                                            "output": json.dumps({"sky": "clear"})})
        _until(conn, "conversation.item.done")
        conn.response.create(response={"tool_choice": "none", "output_modalities": ["text"], "max_output_tokens": 8})
        answer = _until(conn, "response.done")
        assert any(e["type"] == "response.output_text.delta" for e in answer)


def test_bad_events_get_error_events_and_leave_nothing_behind(client, omni_app):
    """Malformed JSON, an unknown type, an append past max_audio_seconds, audio in the wrong format, a cancel of
    nothing: an error event each, the connection open; a cancelled response frees every stage."""
    import websockets.sync.client as ws_client

    url = client.base_url.copy_with(scheme="ws").join("realtime").copy_merge_params({"model": MODEL})
    with ws_client.connect(str(url), max_size=None) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        big = base64.b64encode(bytes(61 * 48000)).decode()  # 61 s: past the graph's max_audio_seconds (60)
        for bad, code in (("{oops", "invalid_json"), (json.dumps({"type": "nope"}), "invalid_event_type"),
                          (json.dumps({"type": "input_audio_buffer.append", "audio": big}), "input_audio_buffer_full"),
                          (json.dumps({"type": "session.update", "session": {
                              "audio": {"input": {"format": {"type": "audio/pcma"}}}}}), "invalid_value"),
                          (json.dumps({"type": "input_audio_buffer.append", "audio": "AAA"}), "invalid_value"),
                          (json.dumps({"type": "response.cancel"}), "response_cancel_not_active")):
            ws.send(bad)
            event = json.loads(ws.recv())
            assert event["type"] == "error" and event["error"]["code"] == code, event
        ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}},
                                                                  "max_output_tokens": 3000, "temperature": 0}}))
        assert json.loads(ws.recv())["type"] == "session.updated"
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk."}]}}))
        ws.send(json.dumps({"type": "response.create"}))
        while json.loads(ws.recv())["type"] != "response.created":  # a 3000-token reply: cancelled long before its end
            pass
        ws.send(json.dumps({"type": "response.cancel"}))
        while (event := json.loads(ws.recv()))["type"] != "response.done":
            pass
        assert event["response"]["status"] == "cancelled"
    assert busy_stages(omni_app) == {}
