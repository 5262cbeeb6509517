"""The served Qwen2.5-Omni graph with its thinker on vLLM at ``tensor_parallel_size: 2`` (two vLLM worker processes
over gloo on CPU; ``test_omni_vllm_graph.py`` has it at 1). Oracle: transformers' ``generate`` on the same checkpoint
(text tokens, then codec tokens and waveform from the talker fed by the tapped hidden states), so a rank that
computed its share wrong, or a tap that sent a rank's partial states, fails it.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from tests.integration.conftest import FIXED_TOPOLOGY, ORACLE, ORACLE_CODE2WAV
from tests.integration.test_omni_graph import (  # noqa: F401 - `reference` is a fixture
    check_against_reference, check_batch_against_reference, oracle_request, reference,
)
from tests.integration.test_omni_vllm_graph import PYTHON, STAGES, pytestmark  # noqa: F401 - the skip reason

APP = "omni_vllm_tp"


@pytest.fixture(scope="module")
def tp_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in STAGES},
        "stages.thinker.engine.backend": "vllm", "stages.thinker.engine.vllm.python": PYTHON,
        "stages.thinker.engine.vllm.max_model_len": 2048, "stages.thinker.engine.vllm.tensor_parallel_size": 2,
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        **ORACLE_CODE2WAV,
    }), name=APP, route_prefix="/vllm_tp")
    yield ray_serve + "/vllm_tp"
    serve.delete(APP)  # vLLM's engine and its two workers: give the memory back for the next modules


@pytest.fixture(scope="module")
def tp_http(tp_app):
    with httpx.Client(base_url=tp_app, timeout=120) as client:
        yield client


def test_the_thinker_runs_two_vllm_ranks_in_their_own_processes(tp_app):
    from ray import serve

    stats = serve.get_deployment_handle("thinker", app_name=APP).ready.remote().result()
    assert stats["backend"] == "vllm" and stats["tensor_parallel_size"] == 2
    assert len(set(stats["worker_pids"])) == 2 and stats["pid"] not in stats["worker_pids"], stats


@pytest.mark.parametrize("kind", ["audio", "image"])
def test_two_ranks_serve_what_transformers_generates(tp_http, reference, kind):
    r = tp_http.post("/v1/chat/completions", json=oracle_request(kind))
    assert r.status_code == 200, r.text
    check_against_reference(r.json(), reference(kind))
    with pytest.raises(AssertionError):  # negative control: the other case's reference fails
        check_against_reference(r.json(), reference("image" if kind == "audio" else "audio"))


def test_four_in_flight_on_two_ranks_each_match_transformers(tp_http, reference):
    check_batch_against_reference(tp_http, reference, 4)


def test_the_ranks_are_gone_with_the_app(tp_app):
    from ray import serve

    pids = serve.get_deployment_handle("thinker", app_name=APP).ready.remote().result()["worker_pids"]
    serve.delete(APP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.5)
    assert not [p for p in pids if os.path.exists(f"/proc/{p}")], pids
