"""The served Qwen2.5-Omni graph over real HTTP: oracle, deployments, OpenAI client, bad input."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import soundfile as sf
import torch

from tests.integration.conftest import ORACLE
from tests.openai_stream import read_stream, sse_has_text
from tests.omni_cases import ALL_CASES, CASES, http_content, http_extras, reference_inputs

pytestmark = pytest.mark.integration
MODEL = "qwen2.5-omni"
SYSTEM = "You are a test assistant."
SAMPLES_PER_CODE = 480


def http_messages(kind: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": http_content(kind)}]


SYSTEM_TURN = {"role": "system", "content": [{"type": "text", "text": SYSTEM}]}  # http_messages' system turn


def oracle_request(kind: str) -> dict:
    return {"model": MODEL, "messages": http_messages(kind), "max_tokens": ORACLE["thinker_tokens"],
            "temperature": 0, "seed": ORACLE["seed"], "modalities": ["text", "audio"],
            "audio": {"voice": "Chelsie", "format": "wav"}, "return_token_ids": True, **http_extras(kind)}


@pytest.fixture(scope="module")
def reference(omni_tiny_dir):
    """transformers' in-process generate on the same checkpoint, its inputs built by transformers' own processor
    from the same media."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_tiny_dir).eval()
    cache = {}

    def run(kind: str):
        if kind in cache:
            return cache[kind]
        x = reference_inputs(omni_tiny_dir, kind, prefix=(SYSTEM_TURN,))
        codes = []
        hook = model.token2wav.register_forward_pre_hook(lambda m, a: codes.append(a[0][0].tolist()))
        torch.manual_seed(ORACLE["seed"])
        seq, wav = model.generate(**x.reference_kwargs(), thinker_max_new_tokens=ORACLE["thinker_tokens"],
                                  talker_max_new_tokens=ORACLE["talker_tokens"], thinker_do_sample=False,
                                  talker_do_sample=False, token2wav_num_steps=ORACLE["steps"])
        hook.remove()
        cache[kind] = (seq[0, x.input_ids.shape[1]:].tolist(), codes[0], wav.numpy())
        return cache[kind]

    return run


def decode_wav(b64: str) -> tuple[np.ndarray, int]:
    samples, sr = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32")
    return samples, sr


def check_against_reference(body: dict, ref) -> None:
    tokens, codes, wav = ref
    choice = body["choices"][0]
    assert choice["token_ids"] == tokens
    assert choice["codec_ids"] == codes
    samples, sr = decode_wav(choice["message"]["audio"]["data"])
    assert sr == 24000 and samples.shape == wav.shape
    np.testing.assert_allclose(samples, wav, atol=2.0 / 32767)  # wav is int16 on the wire


@pytest.mark.parametrize("kind", ALL_CASES)
def test_served_graph_matches_transformers_generate(http, reference, kind):
    r = http.post("/v1/chat/completions", json=oracle_request(kind))
    assert r.status_code == 200, r.text
    check_against_reference(r.json(), reference(kind))


def check_batch_against_reference(client, reference, n: int, cases=CASES) -> None:
    """``n`` oracle requests in flight at once (the ``cases`` mixed) each match the reference."""
    kinds = [cases[i % len(cases)] for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(lambda k: client.post("/v1/chat/completions", json=oracle_request(k)), kinds))
    for kind, r in zip(kinds, responses):
        assert r.status_code == 200, r.text
        check_against_reference(r.json(), reference(kind))


def test_batched_requests_return_what_a_batch_of_one_returns(http, reference):
    """8 oracle requests in flight at once (text, audio, image and video mixed) each match their batch-of-one run."""
    check_batch_against_reference(http, reference, 8, ALL_CASES)


def test_stages_are_separate_deployments_holding_their_own_weights(omni_app, http):
    from ray import serve

    status = serve.status().applications["omni"]
    deployments = status.deployments
    assert {"ingress", "encoder", "thinker", "talker", "code2wav"} <= set(deployments)
    assert all(d.status == "HEALTHY" for d in deployments.values())
    pids = {stage: info["pid"] for stage, info in http.get("/health?fresh=1").json()["stages"].items()}
    assert len(set(pids.values())) == 4
    names = {s: serve.get_deployment_handle(s, app_name="omni").parameter_names.remote().result()
             for s in ("encoder", "thinker", "talker", "code2wav")}
    assert all(n.split(".")[0] in ("audio_tower", "visual") for n in names["encoder"])
    # "layers.": the decoder layers, prepared (omni_serve.models.prepared_decoder)
    assert all(n.split(".")[0] in ("model", "lm_head", "layers") for n in names["thinker"])
    assert not any("audio_tower" in n or "visual" in n or "codec" in n for n in names["thinker"])
    assert all(n.startswith(("talker.", "layers.")) for n in names["talker"])
    assert all(n.startswith("token2wav.") for n in names["code2wav"])


def test_openai_client_non_streaming_and_streaming_audio(omni_app):
    """OpenAI's shapes: the non-streamed reply's text is its audio's transcript (content null); the stream sends
    each piece of text once, as delta.audio.transcript, and pcm16 audio; both carry the same text and audio."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{omni_app}/v1", api_key="unused")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}], modalities=["text", "audio"],
              max_tokens=8, temperature=0, seed=3)
    completion = client.chat.completions.create(**kw, audio={"voice": "Ethan", "format": "wav"},
                                                extra_body={"return_token_ids": True})
    choice = completion.choices[0]
    samples, sr = decode_wav(choice.message.audio.data)
    codes = choice.model_extra["codec_ids"]
    assert sr == 24000 and len(codes) > 0 and samples.size == len(codes) * SAMPLES_PER_CODE
    assert choice.message.content is None and choice.message.audio.transcript

    got = read_stream(client.chat.completions.create(**kw, audio={"voice": "Ethan", "format": "pcm16"}, stream=True,
                                                     stream_options={"include_usage": True}))
    assert got.transcript == choice.message.audio.transcript and got.content == ""
    assert all(c.delta.content is None for chunk in got.chunks for c in chunk.choices)
    pcm = np.frombuffer(got.pcm, dtype="<i2")
    np.testing.assert_array_equal(pcm, np.round(samples * 32768).astype("<i2"))
    assert got.usage.completion_tokens == completion.usage.completion_tokens and got.finish_reason

    # transcript_in_content: the text in content instead (never both)
    moved = read_stream(client.chat.completions.create(**kw, audio={"voice": "Ethan", "format": "pcm16"},
                                                       stream=True, extra_body={"transcript_in_content": True}))
    assert moved.content == got.transcript and moved.transcript == "" and moved.pcm == got.pcm


def test_logprobs_through_the_openai_client_streamed_and_not(omni_app):
    """logprobs: one entry per generated token (the end token included), each with top_logprobs alternatives, the
    chosen token the most likely (greedy); streamed with speech, each chunk carries its tokens' entries and they
    concatenate to the non-streamed list."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{omni_app}/v1", api_key="unused")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=8, temperature=0, seed=3,
              logprobs=True, top_logprobs=3)
    completion = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    choice = completion.choices[0]
    entries = choice.logprobs.content
    assert len(entries) == len(choice.model_extra["token_ids"]) == completion.usage.completion_tokens
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0 and e.bytes == list(e.token.encode())
        assert e.top_logprobs[0].token == e.token and abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    got = read_stream(client.chat.completions.create(**kw, modalities=["text", "audio"], stream=True,
                                                     audio={"voice": "Ethan", "format": "pcm16"}))
    streamed = [e for chunk in got.chunks for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    # the speech request computes its whole prompt; the text one may reuse cached prompt blocks: the same values
    # up to float32 summation order
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert got.transcript == (choice.message.content or "") and got.pcm
    without = client.chat.completions.create(**{k: v for k, v in kw.items() if "logprobs" not in k})
    assert without.choices[0].logprobs is None and without.choices[0].message.content == choice.message.content


def test_a_one_token_reply_with_speech_answers_text_and_empty_audio(http):
    """One text token leaves the talker nothing to speak from: text and zero audio samples, not an error."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"}, "return_token_ids": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    samples, sr = decode_wav(choice["message"]["audio"]["data"])
    assert len(choice["token_ids"]) == 1 and choice["codec_ids"] == [] and samples.size == 0 and sr == 24000
    lines = [line for line in http.post("/v1/chat/completions", json=body | {"stream": True}).text.splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines), lines


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def _with(**kw):
    return json.dumps({**GOOD, **kw})


BAD = {
    "malformed_json": ("post", "/v1/chat/completions", '{"model": "qwen', 400),
    "unknown_model": ("post", "/v1/chat/completions", _with(model="gpt-9"), 400),
    "invalid_modalities": ("post", "/v1/chat/completions", _with(modalities=["video"]), 400),
    "unknown_voice": ("post", "/v1/chat/completions",
                      _with(modalities=["text", "audio"], audio={"voice": "Nobody", "format": "wav"}), 400),
    "undecodable_base64_audio": ("post", "/v1/chat/completions", _with(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "@@not base64@@", "format": "wav"}}]}]), 400),
    "not_audio": ("post", "/v1/chat/completions", _with(messages=[{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"hello" * 100).decode(),
                                                "format": "wav"}}]}]), 400),
    "not_an_image": ("post", "/v1/chat/completions", _with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"xx").decode()}}]}]),
        400),
    "remote_image": ("post", "/v1/chat/completions", _with(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]), 400),
    "context_too_long": ("post", "/v1/chat/completions", _with(max_tokens=100_000), 400),
    "wrong_route": ("get", "/v1/nothing", None, 404),
    "wrong_method": ("get", "/v1/chat/completions", None, 405),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_openai_error_and_next_request_works(http, case):
    method, path, body, status = BAD[case]
    if method == "post":
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.get(path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and "param" in err and "code" in err
    ok = http.post("/v1/chat/completions", json=GOOD)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"] is not None


def test_health_models_metrics(http):
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
    metrics = http.get("/metrics").text
    assert "omni_serve_requests_total" in metrics


def _stage_stats() -> dict[str, dict]:
    from ray import serve

    return {stage: serve.get_deployment_handle(stage, app_name="omni").ready.remote().result()
            for stage in ("encoder", "thinker", "talker", "code2wav")}


def test_client_disconnect_frees_kv_blocks_and_stops_every_stage(omni_app):
    """A client that goes away mid-stream: every stage drops the request, KV block counts return to idle."""
    import time

    import httpx

    idle = _stage_stats()
    body = {**oracle_request("text"), "max_tokens": 2000, "min_tokens": 2000, "stream": True, "temperature": 0.7}
    body["audio"] = {"voice": "Chelsie", "format": "pcm16"}
    with httpx.stream("POST", f"{omni_app}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping the iterator would close the connection right away
        for line in lines:
            if sse_has_text(line):
                break
        busy = _stage_stats()  # mid-stream: the request holds thinker KV blocks
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _stage_stats()
        if all(now[s]["active"] == 0 for s in now) and all(
                now[s]["kv_blocks_used"] == idle[s]["kv_blocks_used"] for s in ("thinker", "talker")):
            break
        time.sleep(0.2)
    assert busy["thinker"]["kv_blocks_used"] > idle["thinker"]["kv_blocks_used"], (busy["thinker"], idle["thinker"])
    assert busy["thinker"]["active"] == 1
    for stage in ("thinker", "talker"):
        assert now[stage]["kv_blocks_used"] == idle[stage]["kv_blocks_used"] == 0, now
        assert now[stage]["kv_blocks_free"] == now[stage]["kv_blocks_total"]
    assert all(now[s]["active"] == 0 for s in now), now
