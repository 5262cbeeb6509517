"""Admission by real-time capacity (omni_serve.realtime_admission) with fake streams: the capacity measured from
delivered audio, who is admitted, who waits and who gets a 429, and that every place is given back (no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from omni_serve.api.errors import OpenAIError
from omni_serve.realtime_admission import AdmissionSpec, RealtimeAdmission
from tests.unit.test_autoscaling import FakeClock


def _admission(policy: str, clock: FakeClock, **kw) -> RealtimeAdmission:
    return RealtimeAdmission(AdmissionSpec(policy=policy, margin=0.2, **kw), buffer_s=0.5, clock=clock)


def _deliver(ticket, clock: FakeClock, chunks: int, every_s: float, seconds: float) -> None:
    for _ in range(chunks):
        clock.t += every_s
        ticket.audio(seconds)


def test_the_capacity_is_the_audio_produced_per_second_of_the_busy_period():
    clock = FakeClock()
    admission = _admission("none", clock)

    async def main():
        ticket = await admission.enter("a")
        clock.t += 0.9  # time to first audio: the first chunk's production, part of the cost
        ticket.audio(0.24)
        assert admission.capacity is None  # 0.9 s of the period: under the 1 s the first estimate waits for
        _deliver(ticket, clock, 4, 0.5, 1.5)
        assert admission.capacity == pytest.approx(6.24 / 2.9)  # from the admission on
        ticket.release()
        ticket.release()  # idempotent
        assert admission.state()["admitted"] == 0 and admission.state()["capacity_audio_s_per_s"] == 2.152
    asyncio.run(main())


def test_a_chunk_counts_over_the_time_it_was_produced_so_the_estimate_does_not_jump_with_chunk_size():
    """Large chunks at a steady 1.4 audio s/s: the estimate is 1.4 at every arrival, where counting each chunk at
    its arrival reads 1.47 when the window holds six of them and 1.23 when it holds five."""
    clock = FakeClock()
    admission = _admission("none", clock)

    async def main():
        ticket = await admission.enter("a")
        readings = []
        for _ in range(20):
            _deliver(ticket, clock, 1, 0.7, 0.98)
            readings.append(admission.capacity)
        assert [r for r in readings if r is not None] == pytest.approx([1.4] * 19)
        ticket.release()
    asyncio.run(main())


def test_reject_admits_while_every_stream_keeps_real_time_with_the_new_one():
    clock = FakeClock()
    admission = _admission("reject", clock)

    async def main():
        first = await admission.enter("a")
        with pytest.raises(OpenAIError) as refused:  # nothing measured yet: one stream at a time
            await admission.enter("b")
        assert refused.value.status_code == 429 and refused.value.headers["Retry-After"] == "1"
        assert refused.value.type == "rate_limit_error"
        _deliver(first, clock, 1, 0.5, 0.24)
        _deliver(first, clock, 4, 0.5, 1.5)  # 6.24 s of audio in 2.5 s: room for a second stream at 1.25x
        second = await admission.enter("b")
        with pytest.raises(OpenAIError):  # a third would get 0.83x: under 1 + margin
            await admission.enter("c")
        assert admission.state() == {"policy": "reject", "admitted": 2, "queued": 0, "max_wait_s": 0.0,
                                     "capacity_audio_s_per_s": 2.496, "one_more": None, "rejected": 2}
        first.release()
        second.release()
    asyncio.run(main())


def test_nothing_new_is_admitted_while_a_stream_is_behind_its_client():
    clock = FakeClock()
    admission = _admission("reject", clock)

    async def main():
        a = await admission.enter("a")
        a.audio(0.24)
        _deliver(a, clock, 4, 0.5, 1.5)  # 3.12 audio s/s; a's client runs dry at 100 + 0.5 + 6.24
        assert admission.can_admit()
        clock.t = 106.7  # nothing more came: within guard_s of running dry
        assert not admission.can_admit()
        a.audio(12.0)  # it caught up: 12 s made since 102, 10.2 s of it in the last 4 s
        assert admission.capacity == pytest.approx(12 * 4 / 4.7 / 4) and admission.can_admit()
        a.release()
    asyncio.run(main())


def test_queue_holds_a_request_until_a_stream_ends_or_its_wait_runs_out():
    clock = FakeClock()
    admission = _admission("queue", clock, max_wait_s=5.0, max_queued=1)

    async def main():
        a = await admission.enter("a")
        waiting = asyncio.ensure_future(admission.enter("b"))
        await asyncio.sleep(0.01)
        assert not waiting.done() and admission.state()["queued"] == 1
        with pytest.raises(OpenAIError):  # the queue is full: a 429 at once
            await admission.enter("c")
        a.release()
        b = await asyncio.wait_for(waiting, 1)
        assert admission.state()["admitted"] == 1 and admission.state()["queued"] == 0
        admission.settings = admission.settings.model_copy(update={"max_wait_s": 0.05})
        with pytest.raises(OpenAIError) as late:
            await admission.enter("d")
        assert "waited" in late.value.message and admission.state()["queued"] == 0
        b.release()
        assert admission.state()["admitted"] == 0
    asyncio.run(main())


def test_by_default_a_request_waits_only_while_it_can_still_meet_the_first_audio_target():
    clock = FakeClock()
    admission = RealtimeAdmission(AdmissionSpec(policy="queue"), buffer_s=0.5, target_ttfp_s=1.0, clock=clock)
    assert admission.max_wait_s == 1.0  # nothing measured: the whole target
    assert RealtimeAdmission(AdmissionSpec(policy="queue", max_wait_s=3), 0.5, 1.0).max_wait_s == 3

    async def main():
        for first_audio_s in (0.7, 0.75, 0.3):
            a = await admission.enter("a")
            clock.t += first_audio_s
            a.audio(0.24)
            clock.t += 1.0
            a.audio(0.24)  # a later chunk: not a first audio
            a.release()
        assert admission.max_wait_s == pytest.approx(0.3)  # the target less the median (0.7)
        assert admission.state()["max_wait_s"] == 0.3
        a = await admission.enter("a")
        with pytest.raises(OpenAIError) as late:  # real time passes here: the wait runs out after 0.3 s
            await admission.enter("b")
        assert late.value.status_code == 429 and "waited 0.3 s" in late.value.message
        a.release()
        for _ in range(4):  # first chunks slower than the target: the shortest wait
            a = await admission.enter("a")
            clock.t += 1.5
            a.audio(0.24)
            a.release()
        assert admission.max_wait_s == pytest.approx(0.1)  # min_wait_s
    asyncio.run(main())

    fast = RealtimeAdmission(AdmissionSpec(policy="queue", min_wait_s=0.0), 0.5, target_ttfp_s=1.0, clock=clock)

    async def first_audio_in(seconds: float) -> None:
        a = await fast.enter("a")
        clock.t += seconds
        a.audio(0.24)
        a.release()
    asyncio.run(first_audio_in(0.25))
    assert fast.max_wait_s == pytest.approx(0.75)  # a fast graph leaves most of the target to wait in
    asyncio.run(first_audio_in(2.0))
    asyncio.run(first_audio_in(2.0))
    assert fast.max_wait_s == 0.0  # min_wait_s 0: no wait at all once the first audio alone misses the target


def test_a_waiting_request_whose_client_leaves_holds_no_place():
    clock = FakeClock()
    admission = _admission("queue", clock, max_wait_s=5.0)

    async def main():
        a = await admission.enter("a")
        waiting = asyncio.ensure_future(admission.enter("b"))
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.sleep(0.01)
        assert admission.state()["queued"] == 0
        a.release()
        assert admission.state()["admitted"] == 0
    asyncio.run(main())


def test_policy_none_admits_everything_and_still_measures():
    clock = FakeClock()
    admission = _admission("none", clock)

    async def main():
        tickets = [await admission.enter(str(i)) for i in range(5)]
        assert admission.state()["admitted"] == 5 and admission.rejected == 0
        for t in tickets:
            t.release()
    asyncio.run(main())


def test_the_autoscaling_stats_say_how_much_capacity_the_waiting_streams_lack():
    clock = FakeClock()
    admission = _admission("reject", clock, retry_after_s=1.0)

    async def main():
        a = await admission.enter("a")
        assert admission.autoscaling_stats() == {"speech_admitted": 1.0, "speech_waiting": 0.0,
                                                 "speech_deficit": 0.0}
        for name in "bc":  # refused before any capacity was measured: one stream at a time is the rule, no deficit
            with pytest.raises(OpenAIError):
                await admission.enter(name)
        assert admission.autoscaling_stats() == {"speech_admitted": 1.0, "speech_waiting": 2.0,
                                                 "speech_deficit": 0.0}
        _deliver(a, clock, 1, 0.5, 0.24)
        _deliver(a, clock, 4, 0.5, 1.5)  # 2.496 audio s/s measured; the two 429s are 2.5 s old: gone
        assert admission.autoscaling_stats()["speech_waiting"] == 0
        b = await admission.enter("b")
        with pytest.raises(OpenAIError):
            await admission.enter("c")
        stats = admission.autoscaling_stats()  # 3 streams x 1.2 wanted, 2.496 there
        assert stats["speech_admitted"] == 2 and stats["speech_waiting"] == 1
        assert stats["speech_deficit"] == pytest.approx(3 * 1.2 / 2.496 - 1)
        clock.t += 1.01  # the refused client would have come back by now
        assert admission.autoscaling_stats()["speech_deficit"] == 0
        a.release()
        b.release()
    asyncio.run(main())


def test_the_retry_after_grows_with_the_line_so_refused_clients_do_not_ask_every_second():
    """A stream lives 14 s and one plays: places free every 14 s. The k-th client refused (none yet due back) is
    told to come back after k x 14 / 8 s, so the line comes back about eight times per place; at most
    max_retry_after_s; once they are due back, the line is short again."""
    clock = FakeClock()
    admission = _admission("reject", clock, max_retry_after_s=10)

    async def main():
        a = await admission.enter("a")
        _deliver(a, clock, 1, 14.0, 0.24)  # a stream that played: its lifetime counts
        a.release()
        b = await admission.enter("b")
        waits = []
        for i in range(7):
            with pytest.raises(OpenAIError) as refused:
                await admission.enter(f"c{i}")
            waits.append(refused.value.headers["Retry-After"])
            assert f"Retry after {waits[-1]} s" in refused.value.message
        assert waits == ["2", "4", "6", "7", "9", "10", "10"]  # ceil(k x 1.75), at most 10
        assert admission.autoscaling_stats()["speech_waiting"] == 7
        clock.t += 10
        assert admission.autoscaling_stats()["speech_waiting"] == 0
        with pytest.raises(OpenAIError) as refused:
            await admission.enter("d")
        assert refused.value.headers["Retry-After"] == "2"
        b.release()
    asyncio.run(main())


def test_streams_start_one_at_a_time_each_once_the_others_have_a_lead():
    """Capacity for three streams: the second is admitted, but a third only once the second has heard its first
    audio and has more than guard_s (1 s) ahead of its client."""
    clock = FakeClock()
    admission = _admission("reject", clock)

    async def main():
        a = await admission.enter("a")
        _deliver(a, clock, 1, 0.5, 0.24)
        _deliver(a, clock, 4, 0.5, 3.0)  # 4.9 audio s/s
        b = await admission.enter("b")
        with pytest.raises(OpenAIError):  # b has not started to play
            await admission.enter("c")
        _deliver(b, clock, 1, 0.5, 0.24)  # its client has 0.74 s ahead
        with pytest.raises(OpenAIError):
            await admission.enter("c")
        _deliver(b, clock, 1, 0.3, 1.0)  # 1.44 s ahead
        assert admission.capacity / 3 >= 1.2
        c = await admission.enter("c")
        for ticket in (a, b, c):
            ticket.release()
    asyncio.run(main())


def test_a_busy_period_shorter_than_a_second_is_measured_when_it_ends():
    """Short streams on a fast graph (1.5 s of audio in 0.6 s): no estimate while the period is under 1 s, one
    when its only stream ends, so the next period can admit more than one stream."""
    clock = FakeClock()
    admission = _admission("reject", clock)

    async def main():
        a = await admission.enter("a")
        _deliver(a, clock, 3, 0.2, 0.5)
        assert admission.capacity is None
        a.release()
        assert admission.capacity == pytest.approx(1.5 / 0.6)
        first = await admission.enter("b")
        _deliver(first, clock, 1, 0.2, 1.5)  # its client has 1.5 + 0.5 s ahead
        second = await admission.enter("c")  # 2.5 audio s/s: two streams at 1.25x
        first.release()
        second.release()
    asyncio.run(main())


def test_a_stream_stuck_before_its_first_audio_holds_admission_back_only_while_it_could_still_be_starting():
    clock = FakeClock()
    admission = _admission("reject", clock)  # target_ttfp_s 1.0

    async def main():
        a = await admission.enter("a")
        _deliver(a, clock, 1, 0.5, 0.24)  # first chunks come 0.5 s after admission
        _deliver(a, clock, 4, 0.5, 3.0)  # 4.9 audio s/s
        stuck = await admission.enter("stuck")
        clock.t += 0.9
        with pytest.raises(OpenAIError):  # still within max(1.0, 2 x 0.5) s of its admission: starting
            await admission.enter("c")
        clock.t += 0.2
        c = await admission.enter("c")  # 1.1 s without audio: stuck, no longer counted
        for ticket in (a, stuck, c):
            ticket.release()
    asyncio.run(main())


def test_the_retry_after_bounds_must_be_ordered():
    with pytest.raises(ValueError, match="max_retry_after_s"):
        AdmissionSpec(retry_after_s=5, max_retry_after_s=2)


def test_streams_cut_at_their_first_audio_do_not_replace_the_estimate():
    """A busy period of one stream cancelled just after its first chunk (a barge-in): 0.24 s of audio over 1.9 s of
    prefill and first chunk is an opening, not the graph's rate; the estimate of the streams before it stands."""
    clock = FakeClock()
    admission = _admission("queue", clock)

    async def main():
        a = await admission.enter("a")
        _deliver(a, clock, 5, 0.5, 1.0)  # 5 s of audio in 2.5 s
        a.release()
        assert admission.capacity == pytest.approx(2.0)
        cut = await admission.enter("b")
        _deliver(cut, clock, 1, 1.9, 0.24)
        clock.t += 0.1
        cut.release()
        assert admission.capacity == pytest.approx(2.0)
        # a later chunk in the window makes it a measure again, the opening included
        c = await admission.enter("c")
        _deliver(c, clock, 2, 1.0, 0.5)
        assert admission.capacity == pytest.approx(0.5)
        c.release()
    asyncio.run(main())


def test_a_realtime_response_waits_its_own_longer_turn():
    """Under queue a chat request waits what the first-audio target leaves; a realtime session's response, which
    no client asks again for, waits ``session_max_wait_s`` and is admitted when a place frees."""
    clock = FakeClock()
    admission = _admission("queue", clock, max_wait_s=0.01, session_max_wait_s=5.0)

    async def main():
        a = await admission.enter("a")
        with pytest.raises(OpenAIError) as refused:
            await admission.enter("chat")
        assert "waited 0.01 s" in refused.value.message
        session = asyncio.ensure_future(admission.enter("response", admission.settings.session_max_wait_s))
        await asyncio.sleep(0.05)
        assert not session.done() and admission.state()["queued"] == 1
        a.release()
        (await asyncio.wait_for(session, 1)).release()
        assert admission.state()["admitted"] == 0 and admission.state()["queued"] == 0
    asyncio.run(main())


def test_a_client_refused_before_keeps_its_place_in_the_line():
    """Two requests wait; one that asks again for what it was first refused earlier goes before both, and a place
    that frees goes to it, then to the others in their order."""
    clock = FakeClock()
    admission = _admission("queue", clock, max_wait_s=5.0)

    async def main():
        playing = await admission.enter("playing")
        refused_at = clock.t  # when the session first asked (it was refused then)
        clock.t += 3.0
        b = asyncio.ensure_future(admission.enter("b"))
        await asyncio.sleep(0.01)
        clock.t += 1.0
        c = asyncio.ensure_future(admission.enter("c"))
        await asyncio.sleep(0.01)
        again = asyncio.ensure_future(admission.enter("again", since=refused_at))
        await asyncio.sleep(0.01)
        assert admission.state()["queued"] == 3
        playing.release()  # one place: the oldest ask
        first = await asyncio.wait_for(again, 1)
        assert not b.done() and not c.done()
        first.release()
        second = await asyncio.wait_for(b, 1)
        assert not c.done()
        second.release()
        (await asyncio.wait_for(c, 1)).release()
        assert admission.state()["admitted"] == 0 and admission.state()["queued"] == 0
    asyncio.run(main())
