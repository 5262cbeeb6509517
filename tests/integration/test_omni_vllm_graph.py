"""The served Qwen2.5-Omni graph with the thinker on vLLM (``stages.thinker.engine.backend: vllm``).

The thinker replica runs in the vLLM environment's interpreter (``make vllm-env``; ``make test`` passes it as
``OMNI_SERVE_VLLM_PYTHON``); without it these tests are skipped with that reason. Oracle: transformers'
``generate`` on the same checkpoint (text tokens, codec tokens, waveform), as for the native thinker.
"""

from __future__ import annotations

import base64
import json
import os
import time

import httpx
import numpy as np
import pytest

from omni_serve.engines.vllm_engine.config import VLLM_PYTHON_ENV
from tests.openai_stream import sse_has_text
from tests.integration.conftest import FIXED_TOPOLOGY, ORACLE, ORACLE_CODE2WAV
from tests.integration.test_omni_graph import (  # noqa: F401 - `reference` is a fixture
    CASES, check_against_reference, check_batch_against_reference, decode_wav, oracle_request, reference,
)

PYTHON = os.environ.get(VLLM_PYTHON_ENV)
pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.skipif(not PYTHON or not os.path.exists(PYTHON),
                       reason=f"no vLLM environment: run `make vllm-env` and set {VLLM_PYTHON_ENV} (make test does)"),
]
APP = "omni_vllm"
STAGES = ("thinker", "talker", "code2wav")


@pytest.fixture(scope="module")
def vllm_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in STAGES},
        "stages.thinker.engine.backend": "vllm", "stages.thinker.engine.vllm.python": PYTHON,
        "stages.thinker.engine.vllm.max_model_len": 2048,
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        **ORACLE_CODE2WAV,
    }), name=APP, route_prefix="/vllm")
    yield ray_serve + "/vllm"
    serve.delete(APP)  # vLLM's engine holds ~3 GiB in its own processes: give them back for the next modules


@pytest.fixture(scope="module")
def vhttp(vllm_app):
    with httpx.Client(base_url=vllm_app, timeout=120) as client:
        yield client


def _stats() -> dict[str, dict]:
    from ray import serve

    return {s: serve.get_deployment_handle(s, app_name=APP).ready.remote().result() for s in STAGES}


def test_thinker_replica_runs_vllm_in_its_own_environment(vllm_app):
    stats = _stats()
    assert stats["thinker"]["backend"] == "vllm"
    assert "encoder" not in stats  # vLLM runs the media towers itself


def test_video_is_refused_with_a_400_on_the_vllm_backend(vhttp):
    r = vhttp.post("/v1/chat/completions", json=oracle_request("video"))
    assert r.status_code == 400 and "not supported with the vLLM thinker backend" in r.json()["error"]["message"]


@pytest.mark.parametrize("kind", CASES)
def test_served_graph_on_vllm_matches_transformers_generate(vhttp, reference, kind):
    r = vhttp.post("/v1/chat/completions", json=oracle_request(kind))
    assert r.status_code == 200, r.text
    check_against_reference(r.json(), reference(kind))


def test_negative_control_a_swapped_prompt_fails_the_oracle(vhttp, reference):
    r = vhttp.post("/v1/chat/completions", json=oracle_request("audio"))
    assert r.status_code == 200, r.text
    with pytest.raises(AssertionError):
        check_against_reference(r.json(), reference("image"))


def test_eight_in_flight_on_vllm_each_match_transformers(vhttp, reference):
    check_batch_against_reference(vhttp, reference, 8)


def test_streamed_reply_equals_the_reference(vllm_app, reference):
    tokens, codes, wav = reference("image")
    body = {**oracle_request("image"), "stream": True, "audio": {"voice": "Chelsie", "format": "pcm16"}}
    text, pcm = [], []
    with httpx.stream("POST", f"{vllm_app}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            for c in json.loads(line[5:])["choices"]:
                audio = c["delta"].get("audio") or {}
                text.append(audio.get("transcript") or "")  # OpenAI's shape: the text as transcript pieces
                if audio.get("data"):
                    pcm.append(base64.b64decode(audio["data"]))
    whole = httpx.post(f"{vllm_app}/v1/chat/completions", json=oracle_request("image"), timeout=120).json()
    assert "".join(text) == whole["choices"][0]["message"]["audio"]["transcript"]
    samples = np.frombuffer(b"".join(pcm), dtype="<i2").astype(np.float32) / 32767.0
    assert samples.shape == wav.shape
    np.testing.assert_allclose(samples, wav, atol=2.0 / 32767)


def test_client_disconnect_aborts_the_vllm_request_and_every_stage(vllm_app):
    body = {**oracle_request("text"), "max_tokens": 1500, "min_tokens": 1500, "stream": True, "temperature": 0.7}
    body["audio"] = {"voice": "Chelsie", "format": "pcm16"}
    with httpx.stream("POST", f"{vllm_app}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping the iterator would close the connection right away
        for line in lines:
            if sse_has_text(line):
                break
        busy = _stats()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _stats()
        if all(now[s]["active"] == 0 for s in STAGES) and now["thinker"]["running"] == 0 and \
                now["talker"]["kv_blocks_used"] == 0:
            break
        time.sleep(0.2)
    assert busy["thinker"]["active"] == 1 and busy["thinker"]["kv_used_fraction"] > 0, busy["thinker"]
    assert now["thinker"]["running"] == 0 and now["thinker"]["waiting"] == 0, now["thinker"]
    assert now["thinker"]["aborted"] >= 1
    assert all(now[s]["active"] == 0 for s in STAGES), now
    assert now["talker"]["kv_blocks_used"] == 0
    # vLLM reports its KV use after each step; the freed blocks show in the next request's first report
    r = httpx.post(f"{vllm_app}/v1/chat/completions", json={**oracle_request("text"), "modalities": ["text"],
                                                               "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    assert _stats()["thinker"]["kv_used_fraction"] < busy["thinker"]["kv_used_fraction"]


def test_seeded_sampling_repeats_and_stop_strings_end_the_text(vhttp):
    sampled = {**oracle_request("text"), "temperature": 0.9, "seed": 11, "modalities": ["text"], "max_tokens": 16}
    first, again = (vhttp.post("/v1/chat/completions", json=sampled).json() for _ in range(2))
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    greedy = vhttp.post("/v1/chat/completions", json={**oracle_request("text"), "modalities": ["text"]}).json()
    text = greedy["choices"][0]["message"]["content"]
    assert len(text) > 4, text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = vhttp.post("/v1/chat/completions", json={**oracle_request("text"), "modalities": ["text"],
                                                   "stop": [stop]}).json()["choices"][0]
    assert cut["message"]["content"] == text[:text.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_speech_on_the_vllm_thinker_equals_the_native_thinker(vhttp, http):
    """/v1/audio/speech with the thinker on vLLM: the forced reply goes in as prompt rows whose states are tapped;
    the speech equals the native thinker's (greedy codec tokens, the same seed)."""
    import io

    import soundfile as sf

    body = {"model": "qwen2.5-omni", "voice": "Chelsie", "input": "hello world cat dog", "response_format": "wav",
            "temperature": 0, "seed": ORACLE["seed"]}
    r_vllm, r_native = vhttp.post("/v1/audio/speech", json=body), http.post("/v1/audio/speech", json=body)
    assert r_vllm.status_code == 200 and r_native.status_code == 200, (r_vllm.text[:300], r_native.text[:300])
    got, sr = sf.read(io.BytesIO(r_vllm.content), dtype="float32")
    want, _ = sf.read(io.BytesIO(r_native.content), dtype="float32")
    assert sr == 24000 and got.size > 0 and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=2.0 / 32767)


def test_presence_and_frequency_penalties_on_vllm_equal_the_native_thinker(vhttp, http):
    """vLLM computes OpenAI's penalties itself: the native thinker's (omni_serve.engines.sampling) give the same
    greedy tokens, and different ones from the unpenalized reply (which repeats no token: a negative presence
    penalty, which favours the tokens already said, is what changes it)."""
    body = {**oracle_request("text"), "modalities": ["text"], "max_tokens": 16, "presence_penalty": -2.0,
            "frequency_penalty": 0.5}
    r_vllm, r_native = vhttp.post("/v1/chat/completions", json=body), http.post("/v1/chat/completions", json=body)
    assert r_vllm.status_code == 200 and r_native.status_code == 200, (r_vllm.text[:300], r_native.text[:300])
    got, want = (r.json()["choices"][0]["token_ids"] for r in (r_vllm, r_native))
    assert got == want and len(got) >= 4
    plain = http.post("/v1/chat/completions", json={k: v for k, v in body.items() if not k.endswith("_penalty")})
    assert plain.json()["choices"][0]["token_ids"] != want


def test_logprobs_on_vllm_equal_the_native_thinkers(vhttp, http):
    """vLLM's logprobs (its default raw_logprobs: log-softmax of the logits before any processor) and their top
    alternatives equal the native thinker's, token for token, to 1e-3 (two implementations of the forward: their
    float32 sums differ in the last bits). With penalties that make the reply repeat tokens, so that a backend
    reporting the penalized distribution instead of the raw one would differ."""
    body = {**oracle_request("text"), "modalities": ["text"], "max_tokens": 16, "logprobs": True, "top_logprobs": 4,
            "presence_penalty": -2.0, "frequency_penalty": 0.5}
    r_vllm, r_native = vhttp.post("/v1/chat/completions", json=body), http.post("/v1/chat/completions", json=body)
    assert r_vllm.status_code == 200 and r_native.status_code == 200, (r_vllm.text[:300], r_native.text[:300])
    got, want = (r.json()["choices"][0] for r in (r_vllm, r_native))
    assert got["token_ids"] == want["token_ids"] and len(got["token_ids"]) >= 4
    got, want = got["logprobs"]["content"], want["logprobs"]["content"]
    assert len(got) == len(want) == len(r_native.json()["choices"][0]["token_ids"])
    for g, w in zip(got, want):
        assert g["token"] == w["token"] and abs(g["logprob"] - w["logprob"]) < 1e-3, (g, w)
        assert len(g["top_logprobs"]) == len(w["top_logprobs"]) == 4
        np.testing.assert_allclose([t["logprob"] for t in g["top_logprobs"]],
                                   [t["logprob"] for t in w["top_logprobs"]], atol=1e-3)


def test_completions_on_vllm_equal_the_native_thinker(vhttp, http):
    """/v1/completions runs on either thinker backend: vLLM's greedy tokens on a raw prompt equal the native
    thinker's, for two prompts in one request, and so do their texts (but for a last partial UTF-8 character, which
    vLLM's detokenizer drops and the native one writes as U+FFFD when the length cuts it)."""
    body = {"model": "qwen2.5-omni", "prompt": ["The quick brown fox", "Once upon a time"], "max_tokens": 12,
            "temperature": 0, "return_token_ids": True}
    r_vllm, r_native = vhttp.post("/v1/completions", json=body), http.post("/v1/completions", json=body)
    assert r_vllm.status_code == 200 and r_native.status_code == 200, (r_vllm.text[:300], r_native.text[:300])
    got, want = ([c["token_ids"] for c in r.json()["choices"]] for r in (r_vllm, r_native))
    assert got == want and all(len(t) >= 4 for t in got)
    texts = ([c["text"].rstrip("\ufffd") for c in r.json()["choices"]] for r in (r_vllm, r_native))
    assert next(texts) == next(texts)


def test_a_json_schema_on_vllm_equals_the_native_thinker(vhttp, http):
    """A JSON response_format on vLLM (its guidance backend: llguidance, the native thinker's grammar engine, compact
    JSON on both): the same greedy tokens as the native thinker, JSON the schema accepts."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    body = {**oracle_request("text"), "modalities": ["text"], "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}
    r_vllm, r_native = vhttp.post("/v1/chat/completions", json=body), http.post("/v1/chat/completions", json=body)
    assert r_vllm.status_code == 200 and r_native.status_code == 200, (r_vllm.text[:300], r_native.text[:300])
    got, want = (r.json()["choices"][0] for r in (r_vllm, r_native))
    assert got["token_ids"] == want["token_ids"] and got["message"]["content"] == want["message"]["content"]
    jsonschema.validate(json.loads(got["message"]["content"]), schema)


def test_a_forced_tool_call_on_vllm_equals_the_native_thinker(vhttp, http):
    """A named tool_choice on vLLM (the call's Lark grammar through its guidance backend): the same greedy tokens and
    the same call as the native thinker, arguments the tool's schema accepts."""
    import jsonschema

    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
              "additionalProperties": False}
    body = {**oracle_request("text"), "modalities": ["text"], "max_tokens": 160,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": params}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    r_vllm, r_native = vhttp.post("/v1/chat/completions", json=body), http.post("/v1/chat/completions", json=body)
    assert r_vllm.status_code == 200 and r_native.status_code == 200, (r_vllm.text[:300], r_native.text[:300])
    got, want = (r.json()["choices"][0] for r in (r_vllm, r_native))
    assert got["token_ids"] == want["token_ids"] and got["finish_reason"] == "tool_calls"
    (call,), (native_call,) = got["message"]["tool_calls"], want["message"]["tool_calls"]
    assert call["function"] == native_call["function"] and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)


def test_logit_bias_on_vllm_equals_the_native_thinker(vhttp, http):
    """logit_bias (-100 on the plain reply's first token, +2 on its third) changes the greedy reply, identically on
    vLLM and on the native thinker."""
    body = {**oracle_request("text"), "modalities": ["text"], "max_tokens": 12}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]
    body["logit_bias"] = {str(plain[0]): -100, str(plain[2]): 2}
    r_vllm, r_native = vhttp.post("/v1/chat/completions", json=body), http.post("/v1/chat/completions", json=body)
    assert r_vllm.status_code == 200 and r_native.status_code == 200, (r_vllm.text[:300], r_native.text[:300])
    got, want = (r.json()["choices"][0]["token_ids"] for r in (r_vllm, r_native))
    assert got == want and want[0] != plain[0] and len(want) >= 4
