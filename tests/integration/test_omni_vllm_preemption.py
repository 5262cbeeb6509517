"""The vLLM thinker under KV-cache pressure: requests vLLM preempts (and recomputes) still stream the talker the
same hidden states, so text, codec tokens and audio equal each request's batch-of-one run (itself checked
against transformers in ``test_omni_vllm_graph``). A 10-block cache (288 tokens) makes 6 requests in flight collide."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from tests.integration.conftest import FIXED_TOPOLOGY, ORACLE, ORACLE_CODE2WAV
from tests.integration.test_omni_graph import CASES, decode_wav, oracle_request
from tests.integration.test_omni_vllm_graph import PYTHON, pytestmark  # noqa: F401 - same skip and marks

APP = "omni_vllm_pressure"
STAGES = ("thinker", "talker", "code2wav")
BLOCKS, BLOCK_SIZE = 10, 32  # vLLM's CPU attention takes block sizes in multiples of 32


@pytest.fixture(scope="module")
def pressure_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in STAGES},
        "stages.thinker.engine.backend": "vllm", "stages.thinker.engine.vllm.python": PYTHON,
        "stages.thinker.params.max_model_len": (BLOCKS - 1) * BLOCK_SIZE,  # vLLM keeps one block back
        "stages.thinker.engine.vllm.extra_engine_args": {"num_gpu_blocks_override": BLOCKS,
                                                         "block_size": BLOCK_SIZE},
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        **ORACLE_CODE2WAV,
    }), name=APP, route_prefix="/vllm_pressure")
    yield ray_serve + "/vllm_pressure"
    serve.delete(APP)


def _thinker_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("thinker", app_name=APP).ready.remote().result()


def test_preempted_requests_return_what_a_batch_of_one_returns(pressure_app):
    bodies = {kind: {**oracle_request(kind), "max_tokens": 48, "min_tokens": 48} for kind in CASES}
    with httpx.Client(base_url=pressure_app, timeout=180) as client:
        solo = {kind: client.post("/v1/chat/completions", json=body) for kind, body in bodies.items()}
        assert all(r.status_code == 200 for r in solo.values()), [r.text for r in solo.values()]
        assert _thinker_stats()["preempted"] == 0
        kinds = [CASES[i % len(CASES)] for i in range(6)]
        with ThreadPoolExecutor(len(kinds)) as pool:
            together = list(pool.map(lambda k: client.post("/v1/chat/completions", json=bodies[k]), kinds))
    assert _thinker_stats()["preempted"] > 0  # the cache forced vLLM to preempt and recompute
    for kind, r in zip(kinds, together):
        assert r.status_code == 200, r.text
        got, want = r.json()["choices"][0], solo[kind].json()["choices"][0]
        assert len(got["token_ids"]) == 48
        assert got["token_ids"] == want["token_ids"]
        assert got["codec_ids"] == want["codec_ids"]
        np.testing.assert_allclose(decode_wav(got["message"]["audio"]["data"])[0],
                                   decode_wav(want["message"]["audio"]["data"])[0], atol=2.0 / 32767)
