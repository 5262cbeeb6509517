"""Speech under load on the served tiny Qwen2.5-Omni graph, over real HTTP: with admission by real-time capacity
(``playback.admission``), the streams beyond what the graph takes get a 429 with ``Retry-After`` and the streams it
admits play without a stall for a client with the graph's buffer; the ingress reports it on ``/health`` and to
Serve's autoscaler (the capacity the refused streams lack), and every place is given back when the streams end
(tests/integration/test_observability.py finds the stall and gap histograms in a real scrape)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from omni_serve.playback import replay
from tests.integration.conftest import ORACLE, ORACLE_CODE2WAV

pytestmark = pytest.mark.integration
OMNI_STAGES = ("encoder", "thinker", "talker", "code2wav")
BUFFER_S = 0.5


@pytest.fixture(scope="module")
def admitting_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    # the shipped sizing (no FIXED_TOPOLOGY): one code2wav replica per CPU of the session's 2-CPU Ray
    serve.run(build_app({
        "checkpoint": omni_tiny_dir, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in OMNI_STAGES},
        "stages.talker.params.max_codec_tokens": 200, **ORACLE_CODE2WAV,
        # a margin no capacity meets: one stream at a time, the rest refused at once (projected from the stages'
        # CPU use, which the ingress reads while a stream plays)
        "playback.admission.policy": "reject", "playback.admission.margin": 1000, "playback.admission.one_more": "auto",
        "playback.admission.retry_after_s": 2, "playback.client_buffer_s": BUFFER_S,
    }), name="omni_admission", route_prefix="/admission")
    yield ray_serve + "/admission"
    serve.delete("omni_admission")


async def _speak(client: httpx.AsyncClient, url: str, i: int) -> dict:
    body = {"model": "qwen2.5-omni", "voice": "Chelsie", "input": f"hello world cat dog number {i}",
            "response_format": "pcm", "temperature": 0, "seed": i}
    t0 = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/audio/speech", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "headers": dict(r.headers), "body": (await r.aread()).decode()}
        chunks = [[time.perf_counter() - t0, len(c) / 2 / 24000] async for c in r.aiter_raw() if c]
    return {"status": 200, "chunks": chunks}


async def _speak_alone(url: str, i: int) -> dict:
    async with httpx.AsyncClient(timeout=300) as client:
        return await _speak(client, url, i)


def test_streams_beyond_the_capacity_get_a_429_and_the_admitted_ones_never_stall(admitting_app):
    from ray import serve

    ingress = serve.get_deployment_handle("ingress", "omni_admission")

    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.ensure_future(_speak(client, admitting_app, i)) for i in range(4)]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)  # a 429, at once
            # what Serve's autoscaler hears from the ingress while a refused client is due back
            stats = await asyncio.to_thread(lambda: ingress.record_autoscaling_stats.remote().result())
            return await asyncio.gather(*tasks), stats

    results, stats = asyncio.run(burst())
    # the fresh graph has no capacity measured yet: one stream at a time is the rule, so no deficit is claimed
    # (its arithmetic is tests/unit/test_realtime_admission.py's)
    assert set(stats) == {"speech_admitted", "speech_waiting", "speech_deficit"}, stats
    assert stats["speech_admitted"] == 1 and stats["speech_waiting"] >= 1 and stats["speech_deficit"] == 0, stats
    served = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    assert served and refused and len(served) + len(refused) == 4, [r["status"] for r in results]
    for r in refused:
        assert r["status"] == 429 and r["headers"]["retry-after"] == "2", r
        assert "real-time capacity" in r["body"] and "rate_limit_error" in r["body"]
    for r in served:
        heard = replay([tuple(c) for c in r["chunks"]], BUFFER_S)
        assert heard.audio_s == pytest.approx(200 / 50, abs=0.05) and heard.stalls == 0, heard
    # every place is given back: a new stream is admitted once the others ended
    alone = asyncio.run(_speak_alone(admitting_app, 9))
    assert alone["status"] == 200
    state = httpx.get(f"{admitting_app}/health?fresh=1", timeout=60).json()["ingress"]["realtime"]
    assert state["policy"] == "reject" and state["admitted"] == 0 and state["rejected"] == len(refused), state


def test_the_default_graph_is_sized_to_the_cluster(admitting_app):
    from ray import serve

    deployments = serve.status().applications["omni_admission"].deployments
    assert deployments["code2wav"].replica_states.get("RUNNING") == 2, deployments["code2wav"]
    assert deployments["talker"].replica_states.get("RUNNING") == 1


def test_the_stages_report_the_cpu_use_admission_projects(admitting_app):
    """What the ingress' admission reads of the served stages (``StageCpuReader`` over their handles, as the ingress
    builds it): every stage's CPU use from one replica with the replicas its handle routes to, and the cluster's
    CPUs; the engines that computed the streams above show CPU spent in their steps, within their process'."""
    from ray import serve

    from omni_serve.deployments.stage_cpu import StageCpuReader

    handles = {s: serve.get_deployment_handle(s, "omni_admission") for s in OMNI_STAGES}
    asyncio.run(_speak_alone(admitting_app, 11))  # the stages' CPU is read over their last seconds

    async def read():
        for _ in range(100):  # until every handle has heard its replicas from Serve (the ingress' have long since)
            await asyncio.gather(*(h.ready.remote() for h in handles.values()))
            if all(h.running_replicas_populated() for h in handles.values()):
                break
            await asyncio.sleep(0.1)
        return await StageCpuReader(handles)()

    stages, cores = asyncio.run(read())
    assert cores == 2 and [s.stage for s in stages] == list(OMNI_STAGES)
    by_stage = {s.stage: s for s in stages}
    assert by_stage["code2wav"].replicas == 2 and by_stage["talker"].replicas == 1
    for s in stages:
        assert 0 <= s.fixed_per_s <= s.engine_per_s <= s.per_s, s
    assert by_stage["talker"].engine_per_s > 0 and by_stage["thinker"].engine_per_s > 0, stages
