"""Overload and deadlines on a served graph: a load far above what the ingress admits gets fast 429s with
Retry-After (never timeouts), every admitted request completes, a request past its X-Request-Timeout
deadline ends with a 504 (an error event when streaming), and no in-flight slot leaks — whatever ends the
request (completion, 429, deadline, client gone), the service keeps answering."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import FIXED_TOPOLOGY

pytestmark = pytest.mark.integration

SPEECH = {"model": "qwen2.5-omni", "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"},
          "messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 12, "min_tokens": 12,
          "temperature": 0}
MAX_INFLIGHT = 2


# Each Omni family, serving under SPEECH's model id.
GRAPHS = {"qwen2_5_omni": {"stages.code2wav.params.num_steps": 4}, "qwen3_omni": {"model_name": SPEECH["model"]}}


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def small_app(request, ray_serve):
    """A small-admission graph of each Omni family."""
    from ray import serve

    from omni_serve.deployments.builder import build_app
    from omni_serve.graph.registry import family
    from tests.conftest import tiny_checkpoint

    extra = GRAPHS[request.param]
    app = f"{request.param}_overload"
    serve.run(build_app(family(request.param), {
        "checkpoint": tiny_checkpoint(request.param), **FIXED_TOPOLOGY, "ingress.num_cpus": 0, "ingress.max_inflight_requests": MAX_INFLIGHT,
        "ingress.retry_after_s": 2, **{f"stages.{s}.num_cpus": 0 for s in ("encoder", "thinker", "talker", "code2wav")},
        "stages.talker.params.max_codec_tokens": 40, **extra,
    }), name=app, route_prefix=f"/{app}")
    yield ray_serve + f"/{app}"
    serve.delete(app)


def _ingress(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()["ingress"]


def _stream(url: str, headers: dict | None = None) -> tuple[int, dict, list[str]]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=SPEECH | {"stream": True}, headers=headers,
                      timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
        return r.status_code, dict(r.headers), lines


def _idle(url: str) -> dict:
    deadline = time.monotonic() + 30
    while (state := _ingress(url))["inflight"] != 0:
        assert time.monotonic() < deadline, state
        time.sleep(0.5)
    return state


def test_load_far_above_the_limit_gets_fast_429s_and_every_admitted_request_completes(small_app):
    start = time.monotonic()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(lambda _: _stream(small_app), range(24)))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= MAX_INFLIGHT and statuses.count(429) >= 8, statuses
    for status, headers, lines in results:
        if status == 429:
            assert headers["retry-after"] == "2"
            assert json.loads("".join(lines))["error"]["type"] == "rate_limit_error"
        else:
            assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert time.monotonic() - start < 120  # answers, not timeouts
    state = _idle(small_app)
    assert state["rejected"] >= statuses.count(429)


def test_a_request_past_its_deadline_ends_with_504_and_frees_its_slot(small_app):
    slow = SPEECH | {"max_tokens": 200, "min_tokens": 200}
    r = httpx.post(f"{small_app}/v1/chat/completions", json=slow, headers={"X-Request-Timeout": "0.05"}, timeout=60)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
    with httpx.stream("POST", f"{small_app}/v1/chat/completions", json=slow | {"stream": True},
                      headers={"X-Request-Timeout": "0.05"}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line]
    errors = [json.loads(line[6:]) for line in lines if line.startswith("data: {\"error\"")]
    assert errors and errors[0]["error"]["type"] == "timeout" and lines[-1] == "data: [DONE]"
    bad = httpx.post(f"{small_app}/v1/chat/completions", json=SPEECH, headers={"X-Request-Timeout": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Timeout"
    _idle(small_app)
    assert _stream(small_app)[0] == 200  # and the service goes on


def test_a_client_leaving_mid_stream_frees_its_slot(small_app):
    for _ in range(2 * MAX_INFLIGHT):
        with httpx.stream("POST", f"{small_app}/v1/chat/completions", json=SPEECH | {"stream": True},
                          timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if '"content"' in line:
                    break  # gone
    _idle(small_app)
    assert _stream(small_app)[0] == 200


@pytest.fixture(scope="module")
def queued_app(ray_serve):
    """The tiny Omni graph whose code2wav takes one call at a time and queues one more."""
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app
    from tests.conftest import tiny_checkpoint

    app = "omni_stage_queue"
    serve.run(build_app({
        "checkpoint": tiny_checkpoint("qwen2_5_omni"), **FIXED_TOPOLOGY, "ingress.num_cpus": 0, "ingress.retry_after_s": 3,
        **{f"stages.{s}.num_cpus": 0 for s in ("encoder", "thinker", "talker", "code2wav")},
        "stages.talker.params.max_codec_tokens": 40, "stages.code2wav.params.num_steps": 4,
        "stages.code2wav.max_ongoing_requests": 1, "stages.code2wav.max_queued_requests": 1,
    }), name=app, route_prefix=f"/{app}")
    yield ray_serve + f"/{app}"
    serve.delete(app)


def test_a_saturated_stage_answers_503_with_the_configured_retry_after_at_once(queued_app):
    """Past code2wav's one running and one queued call, a request is a fast 503 (Serve's back-pressure at the
    stage's handle) with the ingress' Retry-After, not a wait into its deadline; a streamed one gets the same
    error as an event; the admitted ones complete."""
    def post(_):
        r = httpx.post(f"{queued_app}/v1/chat/completions", json=SPEECH, timeout=120)
        assert r.headers.get("content-type") == "application/json", (r.status_code, r.headers, r.text[:300])
        return r.status_code, r.headers.get("retry-after"), r.json()

    start = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(post, range(8)))
        streams = list(pool.map(lambda _: _stream(queued_app), range(8)))
    statuses = [status for status, _, _ in results]
    # one running and (by Serve's count, which lags the calls it is assigning) up to one queued call: at least
    # the first is served, and most of the rest are refused at once
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    for status, retry_after, body in results:
        if status == 503:
            assert retry_after == "3" and body["error"]["code"] == "stage_unavailable", body
            assert "code2wav" in body["error"]["message"]
    errors = [json.loads(line[6:])["error"] for _, _, lines in streams for line in lines
              if line.startswith('data: {"error"')]
    assert errors and {e["code"] for e in errors} == {"stage_unavailable"}, errors
    assert all(lines[-1] == "data: [DONE]" for _, _, lines in streams)
    assert time.monotonic() - start < 120
    assert _idle(queued_app)["inflight"] == 0
