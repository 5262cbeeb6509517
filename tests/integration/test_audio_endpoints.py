"""The audio endpoints over real HTTP on the served Omni graphs, with the official ``openai`` client.

- ``/v1/audio/speech``: greedy speech equals transformers' talker and token2wav driven with the same forced
  thinker states (``tests/speech_cases.py``) on both families; every writable format decodes to that speech;
  SSE and streamed bytes carry the same audio in several pieces; speed changes the duration; bad input is a 400.
- ``/v1/audio/transcriptions``: the transcript equals transformers' greedy thinker on the same prompt, in every
  response format and streamed; bad files are 400s.
"""

from __future__ import annotations

import base64
import io
import json

import av
import numpy as np
import pytest
import soundfile as sf
import torch

from omni_serve.families.qwen2_5_omni.spec import SPEECH_SYSTEM_PROMPT
from omni_serve.families.qwen3_omni.spec import SPEECH_SYSTEM_PROMPT as QWEN3_SPEECH_SYSTEM_PROMPT
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from tests.integration.conftest import ORACLE, TRANSCRIPT_TOKENS
from tests.omni_cases import audio_clip
from tests.speech_cases import qwen2_5_speech, qwen3_speech, speech_prompt

pytestmark = pytest.mark.integration
TEXT = "hello world cat dog"
SPEECH = {"model": "qwen2.5-omni", "voice": "Chelsie", "input": TEXT, "response_format": "wav",
          "extra_body": {"temperature": 0, "seed": ORACLE["seed"]}}


def wav_file(samples: np.ndarray, sr: int = 16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def decoded(data: bytes) -> np.ndarray:
    """Any audio file's samples (PyAV), as float32."""
    with av.open(io.BytesIO(data)) as c:
        return np.concatenate([f.to_ndarray().reshape(-1).astype(np.float32) for f in c.decode(audio=0)])


@pytest.fixture(scope="module")
def client(omni_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{omni_app}/v1", api_key="unused", timeout=300)


@pytest.fixture(scope="module")
def speech_reference(omni_tiny_dir):
    """transformers' Qwen2.5-Omni talker + token2wav on the thinker states of the forced text."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_tiny_dir).eval()
    x, forced = speech_prompt(OmniInputProcessor(omni_tiny_dir), TEXT, SPEECH_SYSTEM_PROMPT)
    return qwen2_5_speech(model, x, forced, ORACLE["talker_tokens"], ORACLE["steps"], ORACLE["seed"])


def test_speech_equals_transformers_on_forced_states(client, speech_reference):
    codes, wav = speech_reference
    reply = client.audio.speech.create(**SPEECH)
    samples, sr = sf.read(io.BytesIO(reply.content), dtype="float32")
    assert sr == 24000 and len(codes) > 0 and samples.shape == wav.shape
    np.testing.assert_allclose(samples, np.clip(wav, -1, 1), rtol=0, atol=1e-4 * np.abs(wav).max() + 2 / 32767)
    other = client.audio.speech.create(**{**SPEECH, "input": "the quick brown fox jumps"})
    assert other.content != reply.content  # negative control: another text is other speech


def test_speech_streams_the_same_audio_in_pieces(client, omni_app):
    import httpx

    whole = client.audio.speech.create(**{**SPEECH, "response_format": "pcm"}).content
    with client.audio.speech.with_streaming_response.create(**{**SPEECH, "response_format": "pcm"}) as r:
        assert r.headers["content-type"].startswith("audio/pcm")
        streamed = b"".join(r.iter_bytes())
    assert streamed == whole and len(whole) > 0
    body = {k: v for k, v in SPEECH.items() if k != "extra_body"} | SPEECH["extra_body"]
    events = []
    with httpx.stream("POST", f"{omni_app}/v1/audio/speech", json=body | {"response_format": "pcm",
                                                                          "stream_format": "sse"}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1  # first audio before the whole text is spoken
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav"])
def test_speech_formats_decode_to_the_speech(client, fmt):
    pcm = np.frombuffer(client.audio.speech.create(**{**SPEECH, "response_format": "pcm"}).content, dtype="<i2")
    data = client.audio.speech.create(**{**SPEECH, "response_format": fmt}).content
    got = decoded(data)
    # lossy codecs pad and shift by a few ms: the duration is what holds (Opus decodes at 48 kHz)
    rate = 48000 if fmt == "opus" else 24000
    assert abs(got.size / rate - pcm.size / 24000) < 0.15


def test_speech_speed_changes_the_duration(client):
    normal = client.audio.speech.create(**{**SPEECH, "response_format": "pcm"}).content
    fast = client.audio.speech.create(**{**SPEECH, "response_format": "pcm", "speed": 2.0}).content
    assert abs(len(fast) / len(normal) - 0.5) < 0.1


BAD_SPEECH = {
    "empty_input": ({"input": ""}, "input"),
    "long_input": ({"input": "a" * 4097}, "input"),
    "unknown_voice": ({"voice": "Nobody"}, "voice"),
    "unknown_format": ({"response_format": "ogg"}, "response_format"),
    "too_fast": ({"speed": 5}, "speed"),
    "too_slow": ({"speed": 0.1}, "speed"),
    "unknown_model": ({"model": "gpt-4o-mini-tts"}, "model"),
    "bad_stream_format": ({"stream_format": "chunks"}, "stream_format"),
}


@pytest.mark.parametrize("case", sorted(BAD_SPEECH))
def test_bad_speech_requests_are_openai_400s(http, case):
    change, param = BAD_SPEECH[case]
    body = {"model": "qwen2.5-omni", "voice": "Chelsie", "input": TEXT, **change}
    r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


# -- transcriptions -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transcript_reference(omni_tiny_dir):
    """transformers' greedy thinker on the transcription prompt, built by transformers' processor."""
    from transformers import AutoProcessor, Qwen2_5OmniForConditionalGeneration

    proc = AutoProcessor.from_pretrained(omni_tiny_dir)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_tiny_dir).eval()
    messages = [{"role": "system", "content": [{"type": "text", "text": "You are a speech recognition model."}]},
                {"role": "user", "content": [{"type": "audio"},
                                             {"type": "text", "text": "Transcribe the audio into text."}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    x = proc(text=[text], audio=[audio_clip()], return_tensors="pt")
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        seq = model.thinker.generate(**x, max_new_tokens=TRANSCRIPT_TOKENS, do_sample=False, eos_token_id=im_end)
    ids = seq[0, x["input_ids"].shape[1]:].tolist()
    return proc.tokenizer.decode([t for t in ids if t != im_end], skip_special_tokens=True)


def test_transcription_equals_transformers(client, transcript_reference):
    upload = ("clip.wav", wav_file(audio_clip()), "audio/wav")
    got = client.audio.transcriptions.create(model="qwen2.5-omni", file=upload)
    assert got.text == transcript_reference and got.text
    assert client.audio.transcriptions.create(model="qwen2.5-omni", file=upload,
                                              response_format="text") == transcript_reference
    verbose = client.audio.transcriptions.create(model="qwen2.5-omni", file=upload, response_format="verbose_json",
                                                 language="en")
    assert verbose.text == transcript_reference and verbose.duration == 1.0 and verbose.language == "en"
    stream = client.audio.transcriptions.create(model="qwen2.5-omni", file=upload, stream=True)
    events = list(stream)
    assert "".join(e.delta for e in events if e.type == "transcript.text.delta") == transcript_reference
    assert events[-1].type == "transcript.text.done" and events[-1].text == transcript_reference
    other = client.audio.transcriptions.create(model="qwen2.5-omni", file=upload, prompt="names: Ada, Bob")
    assert other.text != transcript_reference  # negative control: the prompt reaches the thinker


BAD_TRANSCRIPTIONS = {
    "not_audio": ({"file": ("x.wav", b"this is not audio", "audio/wav")}, {}, "file"),
    "empty_file": ({"file": ("x.wav", b"", "audio/wav")}, {}, "file"),
    "oversized_file": ({"file": ("x.wav", b"\0" * 600_000, "audio/wav")}, {}, "file"),
    "srt": (None, {"response_format": "srt"}, "response_format"),
    "unknown_model": (None, {"model": "whisper-1"}, "model"),
    "no_file": ({}, {}, "file"),
}


@pytest.mark.parametrize("case", sorted(BAD_TRANSCRIPTIONS))
def test_bad_transcription_requests_are_openai_400s(http, case):
    files, change, param = BAD_TRANSCRIPTIONS[case]
    files = {"file": ("clip.wav", wav_file(audio_clip()), "audio/wav")} if files is None else files
    r = http.post("/v1/audio/transcriptions", data={"model": "qwen2.5-omni", **change}, files=files)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


# -- Qwen3-Omni ---------------------------------------------------------------------------------------------
def test_qwen3_speech_equals_transformers_on_forced_states(qwen3_app, qwen3_omni_tiny_dir):
    from openai import OpenAI
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_tiny_dir).eval()
    x, forced = speech_prompt(OmniInputProcessor(qwen3_omni_tiny_dir), TEXT, QWEN3_SPEECH_SYSTEM_PROMPT)
    frames, wav = qwen3_speech(model, x, forced, ORACLE["talker_tokens"])
    client = OpenAI(base_url=f"{qwen3_app}/v1", api_key="unused", timeout=300)
    reply = client.audio.speech.create(**{**SPEECH, "model": "qwen3-omni", "voice": "Ethan"})
    samples, sr = sf.read(io.BytesIO(reply.content), dtype="float32")
    assert sr == 24000 and len(frames) > 0 and samples.shape == wav.shape
    np.testing.assert_allclose(samples, np.clip(wav, -1, 1), rtol=0, atol=1e-4 * np.abs(wav).max() + 2 / 32767)
    upload = ("clip.wav", wav_file(audio_clip()), "audio/wav")
    assert isinstance(client.audio.transcriptions.create(model="qwen3-omni", file=upload).text, str)


# -- vLLM-Omni's chat stream shape ---------------------------------------------------------------------------
def test_vllm_omni_stream_shape_carries_the_same_text_and_audio(client, omni_app, http):
    import httpx

    body = {"model": "qwen2.5-omni", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0, "seed": 3, "modalities": ["text", "audio"], "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{omni_app}/v1/chat/completions", json=body, timeout=300,
                      headers={"X-Omni-Stream-Format": "vllm_omni"}) as r:
        assert r.status_code == 200
        lines = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("modality") == "text")
    wavs = [sf.read(io.BytesIO(base64.b64decode(c["choices"][0]["delta"]["content"])), dtype="int16")
            for c in chunks if c.get("modality") == "audio"]
    assert wavs and all(sr == 24000 for _, sr in wavs)
    whole = http.post("/v1/chat/completions", json={**body, "stream": False, "audio": {"voice": "Chelsie",
                                                                                       "format": "wav"}}).json()
    message = whole["choices"][0]["message"]
    assert text == message["audio"]["transcript"] and message.get("content") is None  # OpenAI shape by default
    pcm, _ = sf.read(io.BytesIO(base64.b64decode(message["audio"]["data"])), dtype="int16")
    np.testing.assert_allclose(np.concatenate([w for w, _ in wavs]), pcm, atol=2)  # int16 rounding
    assert chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    bad = http.post("/v1/chat/completions", json=body, headers={"X-Omni-Stream-Format": "grpc"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-omni-stream-format"
