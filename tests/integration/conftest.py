"""One local Ray instance and one served Omni graph for the whole integration session."""

from __future__ import annotations

import os

import pytest

ORACLE = {"thinker_tokens": 12, "talker_tokens": 20, "steps": 3, "seed": 7}


@pytest.fixture(scope="session")
def omni_app(omni_tiny_dir):
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from omni_serve.graphs.qwen2_5_omni import build_app

    ray.init(num_cpus=2, include_dashboard=False, namespace="omni_serve", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8011})
    serve.run(build_app({
        "checkpoint": omni_tiny_dir,
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        "stages.code2wav.params.num_steps": ORACLE["steps"],
    }), name="omni", route_prefix="/")
    yield "http://127.0.0.1:8011"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def http(omni_app):
    import httpx

    with httpx.Client(base_url=omni_app, timeout=120) as client:
        yield client
