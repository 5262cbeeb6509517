"""The Qwen2.5-Omni graph with a disaggregated thinker (thinker_prefill -> thinker_decode) over real HTTP:
the same transformers oracle as the aggregated graph, its own deployments, probes and cleanup."""

from __future__ import annotations

import pytest

from tests.integration import test_omni_graph as aggregated
from tests.integration.conftest import DISAGG_STAGES
from tests.integration.http_waits import wait_until
from tests.integration.test_omni_graph import check_against_reference, check_batch_against_reference, oracle_request
from tests.omni_cases import CASES

pytestmark = pytest.mark.integration
APP = "omni_disagg"
reference = aggregated.reference  # the same transformers oracle (a module-scoped fixture)


@pytest.fixture(scope="module")
def http_disagg(omni_disagg_app):
    import httpx

    with httpx.Client(base_url=omni_disagg_app, timeout=120) as client:
        yield client


def _stats() -> dict[str, dict]:
    from ray import serve

    return {s: serve.get_deployment_handle(s, app_name=APP).ready.remote().result() for s in DISAGG_STAGES}


@pytest.mark.parametrize("kind", CASES)
def test_disaggregated_graph_matches_transformers_generate(http_disagg, reference, kind):
    r = http_disagg.post("/v1/chat/completions", json=oracle_request(kind))
    assert r.status_code == 200, r.text
    check_against_reference(r.json(), reference(kind))


def test_disaggregated_batch_matches_and_frees_every_block(http_disagg, reference):
    check_batch_against_reference(http_disagg, reference, 6)
    stats = {}

    def idle() -> bool:  # the stage calls end just after the response
        stats.update(_stats())
        return all(s["active"] == 0 for s in stats.values())
    wait_until(idle, 30, "a stage still holds a request after the batch ended")
    for stage in ("thinker_prefill", "thinker_decode", "talker"):
        assert stats[stage]["kv_blocks_used"] == 0, stats
    # decode generated from imported KV: it computed far fewer rows than the prompts had
    assert stats["thinker_prefill"]["batched_rows"] > stats["thinker_decode"]["batched_rows"]


def test_disaggregated_layout_deploys_and_probes_its_own_stages(http_disagg):
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert set(deployments) == {"ingress", *DISAGG_STAGES}
    assert all(d.status == "HEALTHY" for d in deployments.values())
    health = http_disagg.get("/health")
    assert health.status_code == 200
    assert set(health.json()["stages"]) == set(DISAGG_STAGES)
    text = http_disagg.post("/v1/chat/completions", json={
        "model": "qwen2.5-omni", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "stream": True}).text
    assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text.replace(" ", "")
