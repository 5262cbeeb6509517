"""Two graphs behind one ingress, served (``omni_serve.deployments.combined``: Qwen2.5-Omni and Qwen3-ASR, the voice
config's pair), with the official ``openai`` client: speech from one graph and transcripts from either, chosen by
``model`` (Qwen3-ASR's equal to ``generate``), ``/v1/models`` listing both, ``/health`` every stage by graph, an
unknown model a 400 naming the served ones, and a transcription session reaching Qwen3-ASR by its ``intent``."""

from __future__ import annotations

import io

import httpx
import pytest
import soundfile as sf

from tests.asr_cases import CLIPS, Reference, wav

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(voice_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{voice_app}/v1", api_key="unused", timeout=300)


def test_speech_and_transcription_from_one_ingress(client, qwen3_asr_tiny_dir):
    with client.audio.speech.with_streaming_response.create(model="qwen2.5-omni", voice="Chelsie", input="hello world",
                                                           response_format="wav") as r:
        speech = r.read()
    samples, rate = sf.read(io.BytesIO(speech), dtype="float32")
    assert rate == 24000 and samples.size > 0
    upload = ("a.wav", wav(CLIPS[3]), "audio/wav")
    asr = client.audio.transcriptions.create(model="qwen3-asr", file=upload, response_format="verbose_json")
    assert [s.tokens for s in asr.segments] == Reference(qwen3_asr_tiny_dir).tokens(CLIPS[3])
    events = list(client.audio.transcriptions.create(model="qwen3-asr", file=upload, stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == asr.text
    omni = client.audio.transcriptions.create(model="qwen2.5-omni", file=upload)
    assert omni.usage.output_tokens > 0  # the Omni thinker's transcript (its own oracle: test_audio_endpoints)


def test_models_health_and_an_unknown_model(voice_app):
    assert [m["id"] for m in httpx.get(f"{voice_app}/v1/models").json()["data"]] == ["qwen2.5-omni", "qwen3-asr"]
    health = httpx.get(f"{voice_app}/health").json()
    assert health["status"] == "ok"
    assert set(health["stages"]) == {"qwen2_5_omni/encoder", "qwen2_5_omni/thinker", "qwen2_5_omni/talker",
                                     "qwen2_5_omni/code2wav", "qwen3_asr/encoder", "qwen3_asr/llm"}
    r = httpx.post(f"{voice_app}/v1/audio/transcriptions", data={"model": "whisper-1"},
                   files={"file": ("a.wav", wav(CLIPS[0]), "audio/wav")})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    assert "'qwen2.5-omni', 'qwen3-asr'" in r.json()["error"]["message"]


def test_a_transcription_session_reaches_the_asr_graph(voice_app):
    import json

    from websockets.sync.client import connect

    url = voice_app.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    with connect(url) as ws:
        created = json.loads(ws.recv(timeout=60))
    assert created["type"] == "session.created" and created["session"]["type"] == "transcription"
