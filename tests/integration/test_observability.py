"""Observability on the served graphs: metrics reach Ray's Prometheus endpoint with Serve's tags, every
metric the Grafana dashboard charts exists in a real scrape, and a request id reaches every stage's logs."""

from __future__ import annotations

import base64
import glob
import json
import os
import re
import time
import uuid

import httpx
import pytest

from tests.integration.conftest import METRICS_PORT

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "grafana", "omni_serve.json")
SPEECH = {"model": "qwen2.5-omni", "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"},
          "messages": [{"role": "user", "content": "say something"}], "max_tokens": 6, "min_tokens": 6,
          "temperature": 0}


def _dashboard_metrics() -> set[str]:
    with open(DASHBOARD) as f:
        board = json.load(f)
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs.append(next(v["query"] for v in board["templating"]["list"] if v["name"] == "application"))
    return {m for e in exprs for m in re.findall(r"\bray_[a-z0-9_]+", e)}


def _traffic(omni_url: str, image_url: str) -> None:
    with httpx.stream("POST", f"{omni_url}/v1/chat/completions", json=SPEECH | {"stream": True}, timeout=120) as r:
        assert r.status_code == 200 and any(line == "data: [DONE]" for line in r.iter_lines())
    assert httpx.post(f"{omni_url}/v1/chat/completions", json=SPEECH, timeout=120).status_code == 200
    assert httpx.post(f"{omni_url}/v1/chat/completions", json=SPEECH | {"model": "nope"}, timeout=60).status_code == 400
    img = httpx.post(f"{image_url}/v1/images/generations", timeout=120,
                     json={"model": "qwen-image", "prompt": "a red square", "size": "64x64"})
    assert img.status_code == 200, img.text


def _missing(scrape: str, wanted: set[str]) -> list[str]:
    """What the scrape lacks: dashboard metrics, Serve's tags, the series this test's traffic makes."""
    missing = sorted(m for m in wanted if not re.search(rf"^{m}(\{{| )", scrape, re.M))
    lines = scrape.splitlines()
    util = [line for line in lines if line.startswith("ray_omni_serve_stage_utilization{")]
    if not any('deployment="thinker"' in line and 'application="omni"' in line for line in util):
        missing.append("utilization of deployment thinker, application omni")
    if not any('deployment="dit"' in line for line in lines
               if line.startswith("ray_omni_serve_stage_diffusion_steps_in_flight{")):
        missing.append("diffusion steps of deployment dit")
    if not re.search(r'^ray_omni_serve_connector_bytes_total\{.*backend="ray".*op="get"', scrape, re.M):
        missing.append("connector bytes of backend ray, op get")
    if not re.search(r'^ray_omni_serve_errors_total\{.*type="invalid_request_error"', scrape, re.M):
        missing.append("errors of type invalid_request_error")
    return missing


def test_every_dashboard_metric_is_exported_with_serve_tags(omni_app, image_app):
    wanted = _dashboard_metrics()
    assert len(wanted) >= 15
    deadline = time.monotonic() + 120
    while True:  # Ray exports on an interval: keep the stages busy until every series has shown up
        _traffic(omni_app, image_app)
        missing = _missing(httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=30).text, wanted)
        if not missing:
            break
        assert time.monotonic() < deadline, f"missing from the scrape: {missing}"
        time.sleep(5)


def _serve_logs_dir() -> str:
    import ray

    return os.path.join(ray._private.worker._global_node.get_logs_dir_path(), "serve")


def test_a_request_id_reaches_the_logs_of_every_stage_it_used(omni_app):
    rid = f"obs-{uuid.uuid4().hex[:12]}"
    r = httpx.post(f"{omni_app}/v1/chat/completions", json=SPEECH, headers={"X-Request-ID": rid}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == rid
    assert r.json()["id"].startswith(f"chatcmpl-{rid}-")
    assert base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    logs = _serve_logs_dir()
    deadline = time.monotonic() + 30
    while True:
        seen = {d for d in ("ingress", "thinker", "talker", "code2wav")
                if any(rid in open(f, errors="replace").read()
                       for f in glob.glob(os.path.join(logs, f"replica_omni_{d}_*.log")))}
        if len(seen) == 4:
            break
        assert time.monotonic() < deadline, f"request id only in the logs of {sorted(seen)}"
        time.sleep(1)
