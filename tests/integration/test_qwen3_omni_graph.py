"""The served Qwen3-Omni graph over real HTTP: oracle (8 in flight), the official OpenAI client streaming and
not, cancellation freeing every stage, bad input."""

from __future__ import annotations

import base64
import io
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf

from tests.integration.conftest import ORACLE
from tests.integration.test_omni_graph import SYSTEM_TURN, http_messages
from tests.openai_stream import read_stream, sse_has_text
from tests.omni_cases import ALL_CASES, http_extras, reference_inputs, video_bytes, video_data_url
from tests.qwen3_inprocess import reference

pytestmark = pytest.mark.integration
MODEL = "qwen3-omni"


def oracle_request(kind: str) -> dict:
    return {"model": MODEL, "messages": http_messages(kind), "max_tokens": ORACLE["thinker_tokens"],
            "temperature": 0, "seed": ORACLE["seed"], "modalities": ["text", "audio"],
            "audio": {"voice": "Ethan", "format": "wav"}, "return_token_ids": True, **http_extras(kind)}


@pytest.fixture(scope="module")
def references(qwen3_omni_tiny_dir):
    """transformers' generate on the same checkpoint, its inputs built by transformers' own processor from the same
    media, per case."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(qwen3_omni_tiny_dir).eval()
    return {kind: reference(model, reference_inputs(qwen3_omni_tiny_dir, kind, prefix=(SYSTEM_TURN,)),
                            ORACLE["thinker_tokens"], ORACLE["talker_tokens"]) for kind in ALL_CASES}


def decode_wav(b64: str) -> tuple[np.ndarray, int]:
    samples, sr = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return samples, sr


def check(body: dict, ref) -> None:
    choice = body["choices"][0]
    assert choice["token_ids"] == ref.tokens
    assert choice["codec_ids"] == [c for frame in ref.frames for c in frame]  # every codebook of every frame
    samples, sr = decode_wav(choice["message"]["audio"]["data"])
    assert sr == 24000 and samples.shape == ref.wav.shape
    np.testing.assert_allclose(samples, ref.wav, atol=2.0 / 32767)  # int16 on the wire (the float wave: unit test)


@pytest.fixture(scope="module")
def client(qwen3_app):
    import httpx

    with httpx.Client(base_url=qwen3_app, timeout=120) as c:
        yield c


def test_eight_in_flight_match_transformers_generate(client, references):
    kinds = [ALL_CASES[i % len(ALL_CASES)] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda k: client.post("/v1/chat/completions", json=oracle_request(k)), kinds))
    for kind, r in zip(kinds, responses):
        assert r.status_code == 200, r.text
        check(r.json(), references[kind])


@pytest.mark.parametrize("kind", ["text", "video_audio"])
def test_openai_client_non_streaming_and_streaming(qwen3_app, references, kind):
    from openai import OpenAI

    client = OpenAI(base_url=f"{qwen3_app}/v1", api_key="unused")
    req = oracle_request(kind)
    kw = {k: req[k] for k in ("model", "messages", "max_tokens", "temperature", "seed", "modalities", "audio")}
    kw["extra_body"] = http_extras(kind)  # the video case: mm_processor_kwargs
    completion = client.chat.completions.create(**kw | {"extra_body": kw["extra_body"] | {"return_token_ids": True}})
    choice = completion.choices[0]
    ref = references[kind]
    assert choice.model_extra["token_ids"] == ref.tokens
    assert choice.model_extra["codec_ids"] == [c for frame in ref.frames for c in frame]
    assert choice.message.content is None and choice.message.audio.transcript

    got = read_stream(client.chat.completions.create(**kw | {"audio": {"voice": "Ethan", "format": "pcm16"}},
                                                     stream=True, stream_options={"include_usage": True}))
    samples = np.frombuffer(got.pcm, dtype="<i2")
    assert got.transcript == choice.message.audio.transcript and got.content == ""
    assert got.usage is not None and got.usage.completion_tokens == len(ref.tokens)
    assert samples.size == ref.wav.size  # all of generate's samples


def _stage_stats() -> dict[str, dict]:
    from ray import serve

    return {stage: serve.get_deployment_handle(stage, app_name="qwen3_omni").ready.remote().result()
            for stage in ("encoder", "thinker", "talker", "code2wav")}


def test_client_disconnect_frees_every_stage(qwen3_app):
    """A client that goes away mid-stream: every stage drops the request, KV blocks all come back."""
    import httpx

    body = {**oracle_request("text"), "max_tokens": 2000, "min_tokens": 2000, "stream": True, "temperature": 0.7}
    body["audio"] = {"voice": "Ethan", "format": "pcm16"}
    with httpx.stream("POST", f"{qwen3_app}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if sse_has_text(line):
                break
        busy = _stage_stats()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _stage_stats()
        if all(s["active"] == 0 for s in now.values()) and now["thinker"]["kv_blocks_used"] == 0 \
                and now["talker"]["kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert busy["thinker"]["active"] == 1 and busy["thinker"]["kv_blocks_used"] > 0
    for stage in ("thinker", "talker"):
        assert now[stage]["kv_blocks_used"] == 0 and now[stage]["kv_blocks_free"] == now[stage]["kv_blocks_total"]
    assert all(s["active"] == 0 for s in now.values()), now


BAD = {
    "unknown_voice": {"modalities": ["text", "audio"], "audio": {"voice": "Chelsea", "format": "wav"}},
    "not_audio": {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": base64.b64encode(b"hello" * 100).decode(), "format": "wav"}}]}]},
    "remote_image": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]},
    "context_too_long": {"max_tokens": 100_000},
    "remote_video": {"messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}]}]},
    "not_a_video": {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(b"hello" * 100).decode()}}]}]},
    "silent_video_heard": {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {
        "url": video_data_url(video_bytes(audio=False))}}]}], "mm_processor_kwargs": {"use_audio_in_video": True}},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_openai_error_and_next_request_works(client, case):
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = client.post("/v1/chat/completions", json=good | BAD[case])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json=good)
    assert ok.status_code == 200, ok.text


def test_a_forced_tool_call_on_qwen3_omni(client):
    """Qwen3-Omni's template shows the tools (the same Qwen tool layout) and a named tool_choice gives one call of that
    function whose arguments the schema accepts."""
    import json

    import jsonschema

    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 160,
        "temperature": 0, "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": params}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)


def test_a_realtime_text_turn_on_qwen3_omni(qwen3_app):
    """/v1/realtime on Qwen3-Omni: a user text item and response.create give the GA events, the spoken answer's
    transcript and audio as the non-streamed chat reply to the same history (greedy, same seed)."""
    import json

    import websockets.sync.client as ws_client

    url = qwen3_app.replace("http://", "ws://") + f"/v1/realtime?model={MODEL}"
    with ws_client.connect(url, max_size=None) as ws:
        assert json.loads(ws.recv())["type"] == "session.created"
        ws.send(json.dumps({"type": "session.update", "session": {
            "temperature": 0, "seed": 5, "max_output_tokens": 8, "audio": {"input": {"turn_detection": None}}}}))
        assert json.loads(ws.recv())["type"] == "session.updated"
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}}))
        ws.send(json.dumps({"type": "response.create"}))
        events = []
        while not events or events[-1]["type"] != "response.done":
            events.append(json.loads(ws.recv()))
    transcript = "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta")
    audio = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    import httpx

    reply = httpx.post(f"{qwen3_app}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "seed": 5,
        "max_tokens": 8, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}}).json()
    assert transcript == reply["choices"][0]["message"]["audio"]["transcript"] and transcript
    assert audio == base64.b64decode(reply["choices"][0]["message"]["audio"]["data"])
