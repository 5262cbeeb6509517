"""Autoscaling without Ray: the engines' load signals (busy meter, backlog, queue) and omni_serve's policies
(on Ray Serve's own AutoscalingContext)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from omni_serve.autoscaling import EngineLoadPolicy, StageRatioPolicy
from omni_serve.engines.ar.engine import AREngine
from omni_serve.engines.base import StageProgram
from omni_serve.engines.batch import BatchEngine, BatchProgram
from omni_serve.engines.load import BusyMeter, DecayingMean
from tests.unit.test_ar_engine import collect, sequence, thinker  # noqa: F401 - thinker is a fixture


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_busy_meter_tracks_the_busy_fraction_of_its_window():
    clock = FakeClock()
    meter = BusyMeter(window_s=5.0, clock=clock)
    assert meter.value() == 0.0
    for _ in range(1000):  # busy 3 of every 4 time units, for 8 windows
        meter.start()
        clock.t += 0.03
        meter.stop()
        clock.t += 0.01
    assert meter.value() == pytest.approx(0.75, abs=0.02)
    meter.start()  # a long busy period counts while it runs
    clock.t += 20
    assert meter.value() > 0.98
    meter.stop()
    clock.t += 25  # idle for 5 windows
    assert meter.value() < 0.01
    meter.start()  # a period that was only a wait is dropped
    clock.t += 10
    meter.discard()
    assert meter.value() < 0.01


def test_decaying_mean_follows_recent_samples():
    clock = FakeClock()
    mean = DecayingMean(window_s=1.0, clock=clock)
    mean.add(1.0)
    assert mean.value() == 1.0
    for _ in range(100):
        clock.t += 0.1
        mean.add(0.25)
    assert mean.value() == pytest.approx(0.25, abs=1e-3)


class _Work(BatchProgram):
    """Needs ``steps`` computes of ``seconds`` each (the compute sleeps: busy time independent of CPU speed)."""

    def __init__(self, steps: int, gate: threading.Event | None = None):
        self.steps, self.gate = steps, gate

    def ready(self):
        return not self.done and (self.gate is None or self.gate.is_set())

    def work(self):
        return "k", self

    def complete(self, result):
        self.steps -= 1
        self.done = self.steps == 0
        return [result] if self.done else []

    def work_left(self):
        return float(self.steps)


def _sleepy(seconds: float):
    def compute(items):
        time.sleep(seconds)
        return [len(items)] * len(items)
    return compute


def test_batch_engine_reports_utilization_backlog_queue_and_work_in_flight():
    async def main():
        engine = BatchEngine("dit", _sleepy(0.02), max_batch=2, max_active=4, work_unit="diffusion_steps")
        await engine.start()
        engine.busy.window_s = 0.5
        gate = threading.Event()

        async def run(steps, g=None):
            return [x async for x in engine.generate(f"r{id(g)}{steps}{time.monotonic()}", _Work(steps, g))]

        # 4 admitted (max_active) + 2 queued for admission, all held back by the gate
        tasks = [asyncio.create_task(run(40, gate)) for _ in range(6)]
        await asyncio.sleep(0.2)
        idle = engine.load()
        assert idle["queued"] == 2 and idle["active"] == 4 and idle["utilization"] < 0.05
        gate.set()
        await asyncio.sleep(1.0)
        busy = engine.load()
        assert busy["utilization"] > 0.6, busy
        assert busy["backlog"] == pytest.approx(1.0)  # 4 ready, 2 per batch: one more batch waiting
        assert busy["batch_occupancy"] > 0.9
        assert 0 < busy["diffusion_steps_in_flight"] <= 4 * 40
        assert busy["load"] >= busy["utilization"] + busy["backlog"]
        await asyncio.gather(*tasks)
        engine.busy.window_s = 0.05
        await asyncio.sleep(0.5)
        done = engine.load()
        assert done["utilization"] < 0.05 and done["active"] == 0 and done["queued"] == 0
        await engine.cleanup()

    asyncio.run(main())


def test_ar_engine_reports_kv_use_and_occupancy(thinker):
    async def main():
        engine = AREngine("thinker", thinker[0])
        await engine.start()
        before = engine.load()
        assert before["kv_used_fraction"] == 0 and before["running"] == 0
        seen = []

        async def watch():
            while True:
                seen.append(engine.load())
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(collect(engine, f"r{i}", sequence(thinker, max_new=24, min_new=24))
                               for i in range(3)))
        watcher.cancel()
        assert max(s["kv_used_fraction"] for s in seen) > 0
        assert max(s["running"] for s in seen) >= 1 and max(s["batch_occupancy"] for s in seen) > 0
        assert max(s["utilization"] for s in seen) > 0
        await engine.cleanup()

    asyncio.run(main())


# -- policies, on Ray Serve's AutoscalingContext -----------------------------------------------------------
def _ctx(stage: str, loads: list[float] | None, current: int | None = None, metric: str = "load"):
    dep = DeploymentID(name=stage, app_name="omni")
    replicas = [ReplicaID(unique_id=f"{stage}{i}", deployment_id=dep) for i in range(len(loads or [1]))]
    metrics = {} if loads is None else {metric: dict(zip(replicas, loads))}
    n = current if current is not None else len(replicas)
    return AutoscalingContext(
        deployment_id=dep, deployment_name=stage, app_name="omni", current_num_replicas=n, target_num_replicas=n,
        running_replicas=replicas, total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics,
        raw_metrics={}, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=time.time(),
        config=AutoscalingConfig(min_replicas=1, max_replicas=8))


def test_engine_load_policy_sizes_the_stage_to_its_target():
    policy = EngineLoadPolicy(target_load=0.5)
    assert policy(_ctx("code2wav", [1.0, 1.0]))[0] == pytest.approx(4.0)  # saturated: double
    assert policy(_ctx("code2wav", [0.1, 0.1]))[0] == pytest.approx(0.4)  # idle: Serve clamps to min
    assert policy(_ctx("code2wav", None, current=3))[0] == 3  # no reports yet: hold
    by_kv = EngineLoadPolicy(target_load=0.8, metric="kv_used_fraction")
    assert by_kv(_ctx("thinker", [0.8, 0.8, 0.8], metric="kv_used_fraction"))[0] == pytest.approx(3.0)


def test_engine_load_policy_rejects_unknown_parameters():
    with pytest.raises(ValueError, match="target"):
        EngineLoadPolicy(target=0.5)


def test_stage_ratio_policy_scales_each_stage_on_its_load_then_keeps_ratios():
    policy = StageRatioPolicy(target_load=0.5, stage_targets={"code2wav": 0.25},
                              ratios=[{"stage": "talker", "per": "thinker", "min": 1, "max": 2}])
    contexts = {c.deployment_id: c for c in (
        _ctx("thinker", [1.0, 1.0]),   # wants 4
        _ctx("talker", [0.2]),         # wants 0.4, but at least 1x thinker: 4
        _ctx("code2wav", [0.5]),       # its own target 0.25: 2
        _ctx("encoder", [0.0]))}       # idle: 0 (Serve clamps to min_replicas)
    desired, _ = policy(contexts)
    by_name = {dep.name: n for dep, n in desired.items()}
    assert by_name == pytest.approx({"thinker": 4.0, "talker": 4.0, "code2wav": 2.0, "encoder": 0.0})
    contexts[_ctx("talker", [0]).deployment_id] = _ctx("talker", [9.0])  # talker wants 18, at most 2x: 8
    by_name = {dep.name: n for dep, n in policy(contexts)[0].items()}
    assert by_name["talker"] == 8


def test_stage_ratio_policy_ignores_ratios_of_stages_not_autoscaled():
    policy = StageRatioPolicy(ratios=[{"stage": "talker", "per": "thinker", "min": 1}])
    ctx = _ctx("talker", [0.7])
    assert policy({ctx.deployment_id: ctx})[0][ctx.deployment_id] == pytest.approx(1.0)


def test_stage_ratio_policy_asks_the_speech_stages_for_the_capacity_waiting_streams_lack():
    """Admitted streams keep code2wav under its target load; the ingress reports a 0.5 deficit (streams wait):
    code2wav and the talker are asked for 1.5x their replicas, the thinker is not; the ingress itself is sized
    on its ongoing requests, as Serve's default policy would."""
    policy = StageRatioPolicy(target_load=0.7, speech={"stages": ["code2wav", "talker"]})
    ingress = _ctx("ingress", [0.5, 0.5], metric="speech_deficit")
    contexts = {c.deployment_id: c for c in (
        ingress, _ctx("thinker", [0.1]), _ctx("talker", [0.3]), _ctx("code2wav", [0.5, 0.5]))}
    by_name = {dep.name: n for dep, n in policy(contexts)[0].items()}
    assert by_name["code2wav"] == pytest.approx(3.0) and by_name["talker"] == pytest.approx(1.5)
    assert by_name["thinker"] == pytest.approx(0.1 / 0.7) and by_name["ingress"] == 0  # no requests: min
    contexts[ingress.deployment_id] = _ctx("ingress", [0.0, 0.0], metric="speech_deficit")  # nobody waits
    by_name = {dep.name: n for dep, n in policy(contexts)[0].items()}
    assert by_name["code2wav"] == pytest.approx(1.0 / 0.7) and by_name["talker"] == pytest.approx(0.3 / 0.7)


def test_speech_scaling_holds_after_a_scale_up_and_ignores_a_small_deficit():
    import copy

    def replace(ctx, **changes):
        ctx = copy.copy(ctx)
        for name, value in changes.items():
            setattr(ctx, name, value)
        return ctx

    policy = StageRatioPolicy(target_load=0.7, speech={"stages": ["code2wav"], "settle_s": 60})
    code2wav = _ctx("code2wav", [0.5, 0.5])
    ingress = _ctx("ingress", [1.0], metric="speech_deficit")
    just_scaled = replace(code2wav, last_scale_up_time=code2wav.current_time - 10, target_num_replicas=4)
    desired = policy({ingress.deployment_id: ingress, code2wav.deployment_id: just_scaled})[0]
    assert desired[code2wav.deployment_id] == 4  # what it asked for, not 2 x 2 again on a stale deficit
    settled = replace(code2wav, last_scale_up_time=code2wav.current_time - 61)
    assert policy({ingress.deployment_id: ingress, code2wav.deployment_id: settled})[0][
        code2wav.deployment_id] == pytest.approx(4.0)
    small = _ctx("ingress", [0.05], metric="speech_deficit")
    assert policy({small.deployment_id: small, code2wav.deployment_id: code2wav})[0][
        code2wav.deployment_id] == pytest.approx(1.0 / 0.7)


def test_speech_scaling_without_the_ingress_in_view_scales_on_load_alone(caplog):
    policy = StageRatioPolicy(speech={"stages": ["code2wav"]})
    ctx = _ctx("code2wav", [0.7])
    with caplog.at_level("WARNING"):
        assert policy({ctx.deployment_id: ctx})[0][ctx.deployment_id] == pytest.approx(1.0)
    assert "ingress" in caplog.text and "autoscaling_config" in caplog.text


def test_stage_program_default_has_no_work_estimate():
    class P(StageProgram):
        def ready(self):
            return False

        def step(self):
            return []

    assert P().work_left() is None


def test_the_wave_stops_its_load_once_the_stage_has_scaled(monkeypatch):
    """``run_wave(stop_at=...)`` against a fake server and a fake Serve status: the load ends ``hold_s`` after
    code2wav first runs two replicas, not at ``load_s``; ``--stop-at`` refuses a malformed value."""
    import argparse

    import httpx

    from omni_serve.bench import autoscale

    polls = {"n": 0}

    def replicas(dashboard, app, client):
        polls["n"] += 1
        return {"code2wav": 2 if polls["n"] >= 3 else 1}, {"code2wav": 2}

    class FakeClient(httpx.Client):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "transport": httpx.MockTransport(lambda r: httpx.Response(200))})

    monkeypatch.setattr(autoscale, "serve_replicas", replicas)
    monkeypatch.setattr(autoscale, "_stage_load", lambda url, client: {})
    monkeypatch.setattr(autoscale.httpx, "Client", FakeClient)
    wave = autoscale.run_wave(autoscale.WaveConfig(url="http://g", dashboard="http://d", app="a", load_s=60,
                                                   concurrency=1, poll_s=0.05, stop_at={"code2wav": 2}, hold_s=0.2,
                                                   max_idle_s=1))
    up = wave.first_t("code2wav", 2)
    assert up is not None and up <= wave.load_end_t < 30, (up, wave.load_end_t)  # not load_s (60)
    assert wave.outcomes and set(wave.outcomes) == {200}
    assert autoscale._stop_at("code2wav=2,talker=3") == {"code2wav": 2, "talker": 3}
    with pytest.raises(argparse.ArgumentTypeError):
        autoscale._stop_at("code2wav=x")
