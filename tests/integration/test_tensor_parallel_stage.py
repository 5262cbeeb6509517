"""The Qwen2.5-Omni thinker and talker at tensor-parallel 2 (``stages.{thinker,talker}.parallel.tensor: 2``),
served over HTTP: each replica is rank 0 of a gloo group with one rank worker in its placement group, each layer's
heads and MLP split between them (one all-reduce per block half), each caching its own KV heads. Six chats of
different lengths in flight give the same greedy tokens as the one-rank graph (the session's ``omni_app``);
another prompt's tokens differ. A spoken reply equals transformers' ``generate`` (text tokens, codec tokens,
waveform). A killed rank worker fails the step's requests with a 503, never a hang, and Serve replaces the replica."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import FIXED_TOPOLOGY, ORACLE, ORACLE_CODE2WAV
from tests.integration.test_omni_graph import check_against_reference, oracle_request, reference  # noqa: F401

pytestmark = pytest.mark.integration

MODEL = "qwen2.5-omni"
STAGES = ("encoder", "thinker", "talker", "code2wav")
PROMPTS = ["hi", "tell me a story about a fox and a crow", "what is 2 + 2?", "a", "name three colours please",
           "good morning to you, how was the night, did you sleep well, and what will you do today?"]


@pytest.fixture(scope="module")
def tp_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in STAGES},
        **{f"stages.{s}.{k}": v for s in ("thinker", "talker") for k, v in (
            ("num_cpus", 0.01), ("parallel.tensor", 2), ("parallel.rank_cpus", 0.01),
            ("parallel.call_timeout_s", 60))},
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        **ORACLE_CODE2WAV,
    }), name="omni_tp", route_prefix="/omni_tp")
    yield ray_serve + "/omni_tp"
    serve.delete("omni_tp")


def _tokens(base: str, prompt: str) -> list[int]:
    r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
        "modalities": ["text"], "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _all(base: str) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _tokens(base, p), PROMPTS))


def _thinker(base: str) -> dict:
    return httpx.get(base + "/health?fresh=1", timeout=60).json()["stages"]["thinker"]


def test_tensor_parallel_thinker_gives_the_same_greedy_tokens(tp_app, omni_app):
    parallel = _thinker(tp_app)["parallel"]
    assert parallel["kinds"] == {"tensor": 2} and parallel["alive"]
    one, two = _all(omni_app), _all(tp_app)
    print("tokens, one rank vs two:", one, two)
    assert two == one
    assert any(a != b for a, b in zip(two, one[1:] + one[:1]))  # another prompt's tokens differ


def test_a_spoken_reply_from_two_rank_thinker_and_talker_equals_transformers(tp_app, reference):
    talker = httpx.get(tp_app + "/health?fresh=1", timeout=60).json()["stages"]["talker"]["parallel"]
    assert talker["kinds"] == {"tensor": 2} and talker["alive"]
    r = httpx.post(tp_app + "/v1/chat/completions", timeout=300, json=oracle_request("audio"))
    assert r.status_code == 200, r.text
    check_against_reference(r.json(), reference("audio"))


def test_a_killed_tensor_parallel_rank_gives_503_and_a_replaced_replica(tp_app):
    workers = _thinker(tp_app)["parallel"]["worker_pids"]
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)  # the same machine: the rank worker's process dies
    statuses, deadline = [], time.monotonic() + 180
    while True:
        r = httpx.post(tp_app + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
            "modalities": ["text"]})
        statuses.append(r.status_code)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text
        assert time.monotonic() < deadline, f"no replica served again: {statuses}"
        time.sleep(1)
    print("statuses after the kill:", statuses)
    assert statuses[0] == 503
    after = _thinker(tp_app)["parallel"]
    assert after["alive"] and after["worker_pids"] != workers
