"""Three graphs behind one ingress, served (``omni_serve.deployments.combined``): VibeVoice and Qwen3-ASR (the voice
config's pair) plus Qwen2.5-Omni, so that speech and transcription are each served by two graphs. With the official
``openai`` client: VibeVoice's streamed speech equals ``generate`` seeded the same, Omni's speech comes from the same
route by ``model``; Qwen3-ASR's transcripts (streamed and not) equal ``generate``, Omni's come from the same route;
``/v1/models`` lists the three, ``/health`` every stage by graph, an unknown model is a 400 naming the served ones,
a transcription session reaches Qwen3-ASR by its ``intent``, and a voice registered over HTTP speaks as its clip
for its key alone."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import soundfile as sf
import torch

from tests.asr_cases import CLIPS, Reference, wav
from tests.integration.conftest import VOICE_SPEECH_TOKENS

pytestmark = pytest.mark.integration
TEXT = "Hello world, this is a test."


@pytest.fixture(scope="module")
def client(voice_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{voice_app}/v1", api_key="unused", timeout=300)


def vibevoice_generate(checkpoint: str, text: str, voice: str, seed: int) -> np.ndarray:
    from transformers import AutoModelForTextToWaveform, AutoProcessor

    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForTextToWaveform.from_pretrained(checkpoint).eval()
    clip, _ = sf.read(f"{checkpoint}/voices/{voice}.wav", dtype="float32")
    messages = [{"role": "0", "content": [{"type": "text", "text": text}, {"type": "audio", "audio": clip}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                           processor_kwargs={"sampling_rate": 24000})
    torch.manual_seed(seed)
    return model.generate(**inputs, max_new_tokens=VOICE_SPEECH_TOKENS)[0][0].numpy()


def test_speech_from_two_graphs_by_model(client, vibevoice_tiny_dir):
    body = {"model": "vibevoice", "voice": "alice", "input": TEXT, "response_format": "pcm", "extra_body": {"seed": 5}}
    with client.audio.speech.with_streaming_response.create(**body) as r:
        streamed = b"".join(r.iter_bytes())
    got = np.frombuffer(streamed, dtype="<i2").astype(np.float32) / 32768
    want = vibevoice_generate(vibevoice_tiny_dir, TEXT, "alice", 5)
    assert got.size == want.size == VOICE_SPEECH_TOKENS * 3200
    assert np.abs(got - np.clip(want, -1, 1)).max() <= 0.5 / 32768 + 2e-4
    cloned = client.audio.speech.create(**{**body, "voice": "x", "extra_body": {
        "seed": 5, "voice_reference": base64.b64encode(open(f"{vibevoice_tiny_dir}/voices/bob.wav", "rb").read())
        .decode()}})
    assert cloned.content != streamed  # another voice, the same seed
    omni = client.audio.speech.create(model="qwen2.5-omni", voice="Chelsie", input="hello world",
                                      response_format="wav")
    samples, rate = sf.read(io.BytesIO(omni.content), dtype="float32")
    assert rate == 24000 and samples.size > 0


def test_transcription_from_two_graphs_by_model(client, qwen3_asr_tiny_dir):
    upload = ("a.wav", wav(CLIPS[3]), "audio/wav")
    asr = client.audio.transcriptions.create(model="qwen3-asr", file=upload, response_format="verbose_json")
    assert [s.tokens for s in asr.segments] == Reference(qwen3_asr_tiny_dir).tokens(CLIPS[3])
    events = list(client.audio.transcriptions.create(model="qwen3-asr", file=upload, stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == asr.text
    omni = client.audio.transcriptions.create(model="qwen2.5-omni", file=upload)
    assert omni.usage.output_tokens > 0  # the Omni thinker's transcript (its own oracle: test_audio_endpoints)


def test_models_health_and_an_unknown_model(voice_app):
    models = [m["id"] for m in httpx.get(f"{voice_app}/v1/models").json()["data"]]
    assert models == ["vibevoice", "qwen3-asr", "qwen2.5-omni"]
    health = httpx.get(f"{voice_app}/health").json()
    assert health["status"] == "ok"
    assert set(health["stages"]) == {"vibevoice/lm", "qwen3_asr/encoder", "qwen3_asr/llm", "qwen2_5_omni/encoder",
                                     "qwen2_5_omni/thinker", "qwen2_5_omni/talker", "qwen2_5_omni/code2wav"}
    r = httpx.post(f"{voice_app}/v1/audio/speech", json={"model": "tts-1", "voice": "alice", "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    assert "'vibevoice', 'qwen2.5-omni'" in r.json()["error"]["message"]


def test_a_transcription_session_reaches_the_asr_graph(voice_app):
    import json

    from websockets.sync.client import connect

    url = voice_app.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
    with connect(url) as ws:
        created = json.loads(ws.recv(timeout=60))
    assert created["type"] == "session.created" and created["session"]["type"] == "transcription"


def test_a_voice_registered_over_http_speaks_and_is_the_keys_own(voice_app, client, vibevoice_tiny_dir):
    with open(f"{vibevoice_tiny_dir}/voices/bob.wav", "rb") as f:
        clip = f.read()
    mine = {"Authorization": "Bearer unused"}  # the key the official client sends: the voice is its
    r = httpx.post(f"{voice_app}/v1/audio/voices", headers=mine, data={"name": "Narrator"},
                   files={"file": ("n.wav", clip)})
    assert r.status_code == 200 and r.json()["id"] == "narrator", r.text
    assert "narrator" in [v["id"] for v in httpx.get(f"{voice_app}/v1/audio/voices", headers=mine).json()["data"]]
    body = {"model": "vibevoice", "input": TEXT, "response_format": "pcm", "extra_body": {"seed": 3}}
    named = client.audio.speech.create(voice="narrator", **body).content
    preset = client.audio.speech.create(voice="bob", **body).content
    assert named == preset  # the registered clip is bob's file, sample for sample
    other_key = {"Authorization": "Bearer someone-else"}
    r = httpx.post(f"{voice_app}/v1/audio/speech", headers=other_key,
                   json={"model": "vibevoice", "voice": "narrator", "input": TEXT})
    assert r.status_code == 400 and r.json()["error"]["param"] == "voice"
    assert httpx.delete(f"{voice_app}/v1/audio/voices/narrator", headers=other_key).status_code == 404
    assert httpx.delete(f"{voice_app}/v1/audio/voices/narrator", headers=mine).json()["deleted"]
    assert httpx.delete(f"{voice_app}/v1/audio/voices/narrator", headers=mine).status_code == 404
