"""Faults and overload on the served GLM-Image graph: a replica of the AR stage or of the DiT is killed while it
holds an image request (which then fails with a 503 within its deadline; the graph recovers, nothing of the request
is left), and a load far above the ingress' admission gets fast 429s while every admitted request completes; a
request past its deadline is a 504 and frees its slot."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.integration.conftest import GLM_STAGES
from tests.integration.http_waits import busy_stages, wait_for_200, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]
APP, MODEL, DEADLINE_S, MAX_INFLIGHT = "glm_faults", "glm-image", 60, 2
# 1024x1024: 1280 visual tokens (~2 s of AR on tiny); then 60 DiT steps of a 256x256 image
SLOW = {"ar": {"size": "1024x1024", "num_inference_steps": 1}, "dit": {"size": "256x256", "num_inference_steps": 60}}


@pytest.fixture(scope="module")
def glm_faults(ray_serve, glm_image_tiny_dir):
    from ray import serve

    from omni_serve.families.glm_image import build_app

    serve.run(build_app({
        "checkpoint": glm_image_tiny_dir, "default_size": "64x64", "default_steps": 2, "ingress.num_cpus": 0,
        "ingress.request_timeout_s": DEADLINE_S, "ingress.max_inflight_requests": MAX_INFLIGHT,
        "ingress.retry_after_s": 2, **{f"stages.{s}.num_cpus": 0 for s in GLM_STAGES},
    }), name=APP, route_prefix=f"/{APP}")
    yield f"{ray_serve}/{APP}"
    serve.delete(APP)


def _post(url: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json={"model": MODEL, "prompt": "a cat", "seed": 1, **body},
                      timeout=DEADLINE_S + 30, **kw)


def _stats(stage: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle(stage, app_name=APP).ready.remote().result(timeout_s=30)


def _replica(stage: str):
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP}#{stage}#")]
    assert len(names) == 1, names
    return ray.get_actor(names[0], namespace="serve")


@pytest.mark.parametrize("stage", ["ar", "dit"])
def test_killing_a_stage_replica_mid_request_fails_fast_and_the_graph_recovers(glm_faults, stage):
    import ray

    wait_for_200(f"{glm_faults}/health", 180, "the graph is not up")
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        future = pool.submit(_post, glm_faults, SLOW[stage])
        wait_until(lambda: _stats(stage)["active"] > 0, 60, f"{stage} never took the request")
        ray.kill(_replica(stage))
        r = future.result()
        took = time.monotonic() - start
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable", r.text
    assert took < DEADLINE_S + 5
    wait_for_200(f"{glm_faults}/health", 180, "the graph did not recover")
    assert _post(glm_faults, {}).status_code == 200  # later requests succeed
    assert not busy_stages(glm_faults)  # and nothing of the failed request is left in any stage


def test_load_far_above_the_limit_gets_fast_429s_and_every_admitted_request_completes(glm_faults):
    start = time.monotonic()
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(lambda i: _post(glm_faults, {"seed": i}), range(12)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= MAX_INFLIGHT and statuses.count(429) >= 4, statuses
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "rate_limit_error"
    assert time.monotonic() - start < 120
    r = _post(glm_faults, SLOW["ar"], headers={"X-Request-Timeout": "0.5"})
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout", r.text
    assert not busy_stages(glm_faults)
    assert _post(glm_faults, {}).status_code == 200
