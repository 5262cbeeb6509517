"""The realtime protocol's pieces without a graph: session.update merges what it names, the session view parses as the
official client's session, client events that cannot be used are problems naming their field, and Silero VAD hears
the speech-like clip as one turn while silence, a steady tone and noise start none."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omni_serve.api import realtime_protocol as R
from omni_serve.api.vad import SpeechDetector
from omni_serve.bench.realtime import speechlike


def test_session_update_changes_only_what_it_names():
    s = R.SessionSettings().updated({"instructions": "Be brief.", "audio": {"output": {"voice": "Ethan"}}})
    assert s.instructions == "Be brief." and s.audio.output.voice == "Ethan"
    assert s.audio.input.turn_detection.type == "server_vad"  # untouched
    s = s.updated({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.7}}}})
    assert s.audio.input.turn_detection.threshold == 0.7 and s.audio.input.turn_detection.silence_duration_ms == 500
    assert s.updated({"audio": {"input": {"turn_detection": None}}}).audio.input.turn_detection is None
    assert s.audio.output.voice == "Ethan"


def test_the_session_view_parses_as_the_clients_session():
    from openai.types.realtime import SessionCreatedEvent

    view = R.SessionSettings(tools=[{"type": "function", "name": "f"}]).view("sess_1", "qwen2.5-omni")
    event = SessionCreatedEvent.model_validate(R.server_event("session.created", session=view))
    assert event.session.audio.input.turn_detection.type == "server_vad"
    assert event.session.audio.output.format.rate == 24000 and event.session.tools[0].name == "f"


@pytest.mark.parametrize(("text", "code", "param"), [
    ("[1, 2]", "invalid_json", None),
    (json.dumps({"type": 5}), "invalid_event_type", "type"),
    (json.dumps({"type": "input_audio_buffer.append"}), "invalid_value", "audio"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "image"}}), "invalid_value", "item"),
    (json.dumps({"type": "conversation.item.truncate", "item_id": "x", "content_index": -1, "audio_end_ms": 0}),
     "invalid_value", "content_index"),
])
def test_events_that_cannot_be_used_are_problems_naming_their_field(text, code, param):
    with pytest.raises(R.RealtimeProblem) as info:
        R.parse_client_event(text)
    assert info.value.code == code and info.value.param == param
    error = info.value.event()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]


def _events(pcm: bytes, piece: int = 4800) -> list:
    detector, out = SpeechDetector(0.5, 300), []
    for i in range(0, len(pcm), piece):
        out += detector.feed(pcm[i:i + piece])
    return out


def test_vad_hears_one_turn_in_speech_and_none_in_silence_tone_or_noise():
    turn = _events(bytes(24000) + speechlike(1.5) + bytes(48000))
    assert [k for k, _ in turn] == ["start", "stop"]
    assert 400 <= turn[0][1] <= 700 and 1700 <= turn[1][1] <= 2300
    assert _events(bytes(24000) + speechlike(1.5) + bytes(48000), piece=1442) == turn  # the pieces do not matter
    t = np.arange(2 * 24000) / 24000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype("<i2").tobytes()
    noise = (np.random.default_rng(0).normal(0, 0.05, 2 * 24000) * 32767).astype("<i2").tobytes()
    for control in (bytes(96000), tone, noise):
        assert _events(control) == []
