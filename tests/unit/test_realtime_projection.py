"""Admission by the stages' CPU use projected to one more stream (omni_serve.realtime_projection, the engines'
``CpuUse``, and ``RealtimeAdmission`` with a CPU source) with fake clocks and fake stages (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from omni_serve.engines.load import CpuUse
from omni_serve.realtime_admission import AdmissionSpec, RealtimeAdmission
from omni_serve.realtime_projection import RESERVE_CPUS, StageCpu, project
from tests.unit.test_autoscaling import FakeClock


def test_cpu_use_is_the_process_cpu_rate_and_the_steps_fixed_part():
    wall, cpu = FakeClock(), FakeClock()
    use = CpuUse(window_s=5.0, clock=wall, cpu_clock=cpu)
    assert use.value() == {"per_s": 0.0, "engine_per_s": 0.0, "fixed_per_s": 0.0}
    # 50 steps per second for a minute, each 4 ms fixed + 1 ms per row, 2 or 6 rows; the process spends 0.7 CPU s/s
    for i in range(3000):
        wall.t += 0.02
        cpu.t += 0.014
        use.step(2 if i % 2 else 6, 0.004 + 0.001 * (2 if i % 2 else 6))
    value = use.value()
    assert value["per_s"] == pytest.approx(0.7, rel=1e-4)
    assert value["engine_per_s"] == pytest.approx(50 * 0.008, rel=0.01)
    assert value["fixed_per_s"] == pytest.approx(50 * 0.004, rel=0.02)  # steps per second times the fixed cost
    wall.t += 30  # idle: nothing spent, nothing fixed
    assert use.value()["per_s"] < 0.01 and use.value()["fixed_per_s"] < 0.01


def test_the_fixed_part_scales_with_the_speed_the_rest_with_the_audio_made():
    talker = StageCpu("talker", per_s=0.6, fixed_per_s=0.4)
    # one stream at 2.4x real time -> two at 1.2x: the same audio per second, the steps at half the rate
    p = project([talker], streams=1, speed=2.4, cores=2, new_streams=2, new_speed=1.2)
    assert p.per_replica["talker"] == pytest.approx(0.4 / 2 + 0.2)
    assert p.fits and p.total_cpus == pytest.approx(0.4) and p.cores == 2 - RESERVE_CPUS
    # the same as the delivered rate's 2.4 / 2 = 1.2 here; the difference is in what follows
    # batching pays: four streams at 1.2x cost less than four times one
    p4 = project([talker], 1, 2.4, 2, 4, 1.2)
    assert p4.total_cpus == pytest.approx(0.2 + 0.2 * 4 * 1.2 / 2.4) and p4.fits


def test_a_stream_that_opens_sets_the_pace_of_the_shared_steps_and_adds_its_own_audio():
    talker = StageCpu("talker", per_s=0.6, fixed_per_s=0.4)
    # one stream at 2.4x -> it at 1.2x and a new one opening at 2x: steps at 2x, 3.2 audio s/s
    p = project([talker], 1, 2.4, 2, 2, 1.2, opening_speed=2.0)
    assert p.per_replica["talker"] == pytest.approx(0.4 * 2.0 / 2.4 + 0.2 * 3.2 / 2.4)
    assert project([talker], 1, 2.4, 2, 2, 1.2, opening_speed=1.2).per_replica["talker"] == pytest.approx(0.4)


def test_a_replicas_engine_thread_cannot_use_more_than_a_cpu_and_the_stages_not_more_than_the_cores():
    """A stage's use is its replicas' in all; each replica with a stream pays its own fixed part."""
    stages = [StageCpu("talker", 0.5, 0.1), StageCpu("code2wav", 0.9, 0.3)]
    p = project(stages, 1, 2.0, cores=4, new_streams=2, new_speed=1.2)
    # code2wav: 0.3 * 0.6 + 0.6 * 2.4 / 2 = 0.9 -> fits one thread; talker 0.06 + 0.4 * 1.2 = 0.54
    assert p.fits and p.per_replica["code2wav"] == pytest.approx(0.9)
    p = project(stages, 1, 2.0, cores=4, new_streams=3, new_speed=1.2)
    assert not p.fits and p.bound == "code2wav"  # 0.18 + 0.6 * 1.8 = 1.26 > its one thread
    two = [StageCpu("talker", 0.5, 0.1), StageCpu("code2wav", 0.9, 0.3, replicas=2)]
    p = project(two, 1, 2.0, cores=4, new_streams=3, new_speed=1.2)
    # two replicas share the three streams (1.5 each: 0.18 + 0.6 * 1.8 / 2 = 0.72), each pays its fixed part
    assert p.fits and p.per_replica["code2wav"] == pytest.approx(0.72)
    assert p.total_cpus == pytest.approx(0.06 + 0.4 * 1.8 + 2 * 0.72)
    p = project(two, 1, 2.0, cores=2, new_streams=3, new_speed=1.2)
    assert not p.fits and p.bound == "cores" and "projected CPU 2.22 of 1.75" in p.describe()
    # both replicas busy now (two streams at 1.5x, 0.9 each of which 0.3 fixed): three at 1.2x
    both = [StageCpu("code2wav", 1.8, 0.6, replicas=2)]
    p = project(both, 2, 1.5, cores=4, new_streams=3, new_speed=1.2)
    assert p.per_replica["code2wav"] == pytest.approx(0.3 * 0.8 + 0.6 * 3.6 / 3.0) and p.fits
    # the process spends more than its engine's steps (payloads moved on its event loop): only the steps are
    # bound by the engine's thread
    busy = [StageCpu("code2wav", 1.1, 0.3, engine_per_s=0.8)]
    p = project(busy, 1, 2.0, cores=4, new_streams=2, new_speed=1.2)
    assert p.fits and p.per_replica["code2wav"] == pytest.approx(0.18 + 0.8 * 1.2)  # 1.14 for the process
    assert not project([StageCpu("code2wav", 1.1, 0.3)], 1, 2.0, 4, 2, 1.2).fits  # all of it the engine's


def test_nothing_is_projected_from_streams_that_are_not_being_produced():
    stage = [StageCpu("code2wav", 0.9, 0.3)]
    assert project(stage, 0, 2.0, 2, 1, 1.2) is None
    assert project(stage, 2, 0.01, 2, 3, 1.2) is None


def _stream(admission, clock, chunks=5):
    async def open_one(name):
        ticket = await admission.enter(name)
        for _ in range(chunks):
            clock.t += 0.5
            ticket.audio(1.1)  # 2.2x real time
        return ticket
    return open_one


def test_admission_admits_by_the_projection_where_every_stage_reports_its_cpu():
    """One stream at 2.2x: the delivered rate alone refuses a second (1.1 each is under 1 + margin); the stages'
    CPU says two fit, or (their shared cores busy) that they do not."""
    clock = FakeClock()
    readings = []

    async def source():
        readings.append(clock.t)
        return stages, 2.0

    async def main(expect_second: bool):
        admission = RealtimeAdmission(AdmissionSpec(policy="reject", margin=0.2), buffer_s=0.5, clock=clock)
        admission.cpu_source = source
        first = await _stream(admission, clock)("a")
        await asyncio.sleep(0)  # the reader's first read
        assert admission.stage_cpu == stages
        if expect_second:
            second = await admission.enter("b")
            second.release()
        else:
            with pytest.raises(Exception) as refused:
                await admission.enter("b")
            assert refused.value.status_code == 429
            assert admission.state()["one_more"].endswith("cores does not fit")
        reader = admission._cpu_task
        first.release()
        await asyncio.sleep(0)  # the reader stops with the busy period, and its reading goes with it
        assert reader.done() and admission._cpu_task is None and admission.stage_cpu is None
        assert len(readings) == 1

    stages = [StageCpu("talker", 0.5, 0.3), StageCpu("code2wav", 0.8, 0.4)]  # two streams at 1.2x: 1.04 CPU
    asyncio.run(main(expect_second=True))
    readings.clear()
    # nothing fixed, two replicas each (no engine thread over one CPU): 1.96 > 1.75
    stages = [StageCpu("talker", 0.8, 0.0, replicas=2), StageCpu("code2wav", 1.0, 0.0, replicas=2)]
    asyncio.run(main(expect_second=False))


def test_a_stream_admitted_as_the_last_one_leaves_gets_a_reader_of_its_own():
    clock = FakeClock()
    reads = []

    async def source():
        reads.append(clock.t)
        return [StageCpu("code2wav", 1.0, 0.0, engine_per_s=1.0)], 8.0  # one more never fits: 2.4 / 2.2 > 1

    async def main():
        admission = RealtimeAdmission(AdmissionSpec(policy="queue", margin=0.2, max_wait_s=60), buffer_s=0.5,
                                      clock=clock)
        admission.cpu_source = source
        first = await _stream(admission, clock)("a")
        waiting = asyncio.ensure_future(admission.enter("b"))
        await asyncio.sleep(0)
        assert not waiting.done() and len(reads) == 1
        first.release()  # the next busy period starts at once with the waiting stream
        second = await waiting
        await asyncio.sleep(0)
        assert len(reads) == 2 and admission._cpu_task is not None and not admission._cpu_task.done()
        second.release()
    asyncio.run(main())


def test_without_a_report_from_every_stage_the_delivered_rate_decides():
    clock = FakeClock()

    async def source():
        return None, 2.0  # a vLLM thinker reports no CPU use

    async def main():
        admission = RealtimeAdmission(AdmissionSpec(policy="reject", margin=0.2), buffer_s=0.5, clock=clock)
        admission.cpu_source = source
        first = await _stream(admission, clock)("a")
        await asyncio.sleep(0)
        assert admission.projection() is None and admission.capacity == pytest.approx(2.2)
        with pytest.raises(Exception):  # 2.2 / 2 is under 1.2
            await admission.enter("b")
        first.release()
    asyncio.run(main())


def test_a_failing_cpu_source_falls_back_to_the_delivered_rate():
    clock = FakeClock()

    async def source():
        raise RuntimeError("stage gone")

    async def main():
        admission = RealtimeAdmission(AdmissionSpec(policy="reject", margin=0.2), buffer_s=0.5, clock=clock)
        admission.stage_cpu = [StageCpu("code2wav", 0.1, 0.0)]
        admission.cpu_source = source
        first = await _stream(admission, clock)("a")
        await asyncio.sleep(0)
        assert admission.stage_cpu is None
        first.release()
    asyncio.run(main())


class _Replicas:
    """A stage's handle (only what ``StageCpuReader`` uses): its router knows ``uses`` (one per replica), and each
    call goes to the replica with the fewest calls in flight, as Serve's router prefers."""

    def __init__(self, uses):
        from types import SimpleNamespace

        self.uses, self.in_flight = uses, [0] * len(uses)
        router = SimpleNamespace(curr_replicas=list(range(len(uses))))
        self._router = SimpleNamespace(_asyncio_router=SimpleNamespace(_active_request_router=router))
        self.cpu_use = SimpleNamespace(remote=self._call)

    def running_replicas_populated(self):
        return True

    async def _call(self):
        i = min(range(len(self.uses)), key=lambda k: self.in_flight[k])
        self.in_flight[i] += 1
        await asyncio.sleep(0)
        self.in_flight[i] -= 1
        return None if self.uses[i] is None else {**self.uses[i], "node_id": "n1", "pid": i}


def test_the_reader_adds_up_every_replica_of_a_stage_not_only_the_idle_one_the_router_prefers():
    import time

    from omni_serve.deployments.stage_cpu import StageCpuReader

    busy, idle = {"per_s": 0.9, "engine_per_s": 0.8, "fixed_per_s": 0.2}, {"per_s": 0.1, "engine_per_s": 0.0,
                                                                             "fixed_per_s": 0.0}
    reader = StageCpuReader({"talker": _Replicas([busy]), "code2wav": _Replicas([idle, busy])})
    reader._cores, reader._cores_at = 2.0, time.monotonic()  # Ray's count, as read last
    stages, cores = asyncio.run(reader())
    assert cores == 2.0 and [s.stage for s in stages] == ["talker", "code2wav"]
    assert stages[0] == StageCpu("talker", 0.9, 0.2, 1, 0.8)
    assert stages[1] == StageCpu("code2wav", 1.0, 0.2, 2, 0.8)  # both replicas, not the idle one alone
    reader.handles["thinker"] = _Replicas([None])  # a stage that does not report (vLLM): nothing is projected
    assert asyncio.run(reader())[0] is None
    reader.handles["thinker"] = _Replicas([busy])
    reader.handles["thinker"]._router._asyncio_router._active_request_router.curr_replicas = []  # scaled to zero
    stages, _ = asyncio.run(reader())
    assert stages[2] == StageCpu("thinker", 0.0, 0.0, 0, 0.0)  # not called: nothing spent


def test_the_autoscaler_hears_the_projected_deficit_of_every_stream_waiting():
    clock = FakeClock()

    async def main():
        admission = RealtimeAdmission(AdmissionSpec(policy="queue", margin=0.2, max_wait_s=5), buffer_s=0.5,
                                      clock=clock)
        first = await _stream(admission, clock)("a")  # 2.2 audio s/s
        # code2wav's replica: 1 CPU, 0.1 of it fixed, at one stream at 2.2x: two streams at 1.2x would need
        # 0.1 * 1.2 / 2.2 + 0.9 * 2.4 / 2.2 = 1.04 of its one thread (nobody is admitted), four need 2.02
        admission.stage_cpu, admission.cores = [StageCpu("code2wav", 1.0, 0.1, engine_per_s=1.0)], 8.0
        waiting = [asyncio.ensure_future(admission.enter(name)) for name in "bcd"]
        await asyncio.sleep(0)
        stats = admission.autoscaling_stats()
        assert stats["speech_admitted"] == 1 and stats["speech_waiting"] == 3
        assert stats["speech_deficit"] == pytest.approx(0.1 * 1.2 / 2.2 + 0.9 * 4.8 / 2.2 - 1)
        for w in waiting:
            w.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        first.release()
    asyncio.run(main())


def test_cpu_use_reads_the_rate_since_the_replica_got_busy_not_diluted_by_the_idle_time_before():
    wall, cpu = FakeClock(), FakeClock()
    use = CpuUse(window_s=5.0, clock=wall, cpu_clock=cpu)
    wall.t += 60  # idle
    assert use.value()["per_s"] == 0.0
    for _ in range(100):  # two seconds at 0.8 CPU s/s, 50 steps per second of 10 ms each
        wall.t += 0.02
        cpu.t += 0.016
        use.step(1, 0.01)
    value = use.value()
    # an uncorrected 5 s average would read about a third of each (1 - e^(-2/5) = 0.33)
    assert value["per_s"] == pytest.approx(0.8, rel=0.02)
    assert value["engine_per_s"] == pytest.approx(0.5, rel=0.02)
    wall.t += 60  # idle again: nothing is read into the quiet
    assert use.value()["per_s"] < 0.01
