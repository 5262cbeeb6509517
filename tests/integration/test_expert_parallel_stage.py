"""The Qwen3-Omni thinker and talker at expert-parallel 2 (``stages.{thinker,talker}.parallel.expert: 2``), served
over HTTP: each replica is rank 0 of a gloo group with one rank worker in its placement group, each keeping 2 of the
4 experts of every MoE layer (transformers' expert-parallel plan, one all-reduce per MoE layer). Six chats of
different lengths in flight give the same greedy tokens as the one-rank graph (the session's ``qwen3_app``), and a
spoken reply the same codec tokens; another prompt's tokens differ."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import ORACLE, QWEN3_STAGES, TRANSCRIPTION

pytestmark = pytest.mark.integration

MODEL = "qwen3-omni"
PROMPTS = ["hi", "tell me a story about a fox and a crow", "what is 2 + 2?", "a", "name three colours please",
           "good morning to you, how was the night, did you sleep well, and what will you do today?"]


@pytest.fixture(scope="module")
def ep_app(ray_serve, qwen3_omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen3_omni import build_app

    serve.run(build_app({
        "checkpoint": qwen3_omni_tiny_dir, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in QWEN3_STAGES},
        **{f"stages.{s}.{k}": v for s in ("thinker", "talker") for k, v in (
            ("num_cpus", 0.01), ("parallel.expert", 2), ("parallel.rank_cpus", 0.01),
            ("parallel.call_timeout_s", 60))},
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"], **TRANSCRIPTION,
    }), name="qwen3_ep", route_prefix="/qwen3_ep")
    yield ray_serve + "/qwen3_ep"
    serve.delete("qwen3_ep")


def _reply(base: str, prompt: str, audio: bool = False) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0,
            "modalities": ["text", "audio"] if audio else ["text"], "return_token_ids": True}
    if audio:
        body["audio"] = {"voice": "Ethan", "format": "wav"}
    r = httpx.post(base + "/v1/chat/completions", timeout=300, json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _all(base: str) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: _reply(base, p)["token_ids"], PROMPTS))


def test_expert_parallel_thinker_gives_the_same_greedy_tokens(ep_app, qwen3_app):
    stages = httpx.get(ep_app + "/health?fresh=1", timeout=60).json()["stages"]
    for stage in ("thinker", "talker"):
        parallel = stages[stage]["parallel"]
        assert parallel["kinds"] == {"expert": 2} and parallel["alive"] and len(parallel["worker_pids"]) == 1
    one, two = _all(qwen3_app), _all(ep_app)
    print("tokens, one rank vs two:", one, two)
    assert two == one
    assert any(a != b for a, b in zip(two, one[1:] + one[:1]))  # another prompt's tokens differ


def test_a_spoken_reply_has_the_same_codec_tokens(ep_app, qwen3_app):
    one, two = _reply(qwen3_app, PROMPTS[1], audio=True), _reply(ep_app, PROMPTS[1], audio=True)
    assert two["token_ids"] == one["token_ids"]
    assert two["codec_ids"] == one["codec_ids"] and len(one["codec_ids"]) > 0
