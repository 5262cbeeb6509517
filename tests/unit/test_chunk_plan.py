"""Chunk sizes planned from what a machine's calls cost: the first chunk carries the lead its client needs, played
back by an independent client model (``omni_serve.playback``) the planned stream never runs dry where the fixed
short first chunk does; a fast machine keeps the short first chunk."""

from __future__ import annotations

import pytest

from omni_serve.kits.omni.replica.chunk_plan import ChunkPlanner, CodeArrivals, OpeningRates
from omni_serve.playback import Playback

AUDIO_PER_CODE = 0.02  # Qwen2.5-Omni: 50 codes a second
SLOW = (0.2, 0.0105)  # seconds per call, per window code: code2wav alone on one core of machine E (~1.3x real time)
FAST = (0.02, 0.001)


def planner(fixed_per_code, margin=0.0, timed=True):
    fixed, per_code = fixed_per_code
    return ChunkPlanner(lambda codes: fixed + per_code * codes if timed else None, AUDIO_PER_CODE, unit=12, cap=96,
                        context_first=12, context_later=24, margin=margin)


def play(plan: ChunkPlanner, fixed_per_code, first: int, buffer_s: float = 0.5, total: int = 600,
         rate: float | None = None, here: int = 24):
    """Produce ``total`` codes of audio one call at a time, chunks sized by ``plan.fit`` after a ``first``-code
    first chunk; a client with ``buffer_s`` plays them. The codes are always there (a talker far ahead of real time)
    or, with ``rate``, ``here`` of them at time 0 and the rest at ``rate`` a second, each call waiting for its
    chunk's codes and 12 more (its right context)."""
    fixed, per_code = fixed_per_code

    def come(end: int) -> float:  # when the codes a chunk ending at ``end`` needs are here
        return 0.0 if rate is None else max(0.0, (min(end + 12, total) - here) / rate)
    t = come(first) + fixed + per_code * (first + 12)
    client = Playback(buffer_s, 0.0)
    client.add(t, first * AUDIO_PER_CODE)
    sent, sizes = first, [first]
    while sent < total:
        def ready_in(codes: int) -> float:
            return max(0.0, come(sent + codes) - t)
        codes = plan.fit(client.due() - t, ready_in=ready_in) or 96  # none fits: a whole chunk (it stalls once)
        codes = min(codes, total - sent)
        t = max(t, come(sent + codes)) + fixed + per_code * (codes + 24)
        client.add(t, codes * AUDIO_PER_CODE)
        sent += codes
        sizes.append(codes)
    return client.figures(), sizes


def test_a_slow_machine_gets_a_first_chunk_long_enough_that_its_client_never_runs_dry():
    plan = planner(SLOW)
    first = plan.first(0.5, 12)
    # 0.5 s buffer + 0.48 s of audio: just above the lead (0.95 s) under which no chunk size keeps up here
    assert first == 24
    heard, sizes = play(plan, SLOW, first)
    assert heard.stalls == 0, sizes
    assert sizes[:3] == [24, 48, 48]  # the largest chunk that lands in time
    # with a margin for slower calls than estimated, more lead: the chunks then grow to the cap
    careful = planner(SLOW, margin=0.25)
    heard, sizes = play(careful, SLOW, careful.first(0.5, 12))
    assert heard.stalls == 0 and sizes[:4] == [60, 84, 96, 96]
    # the short first chunk this machine cannot follow: its client runs dry, and the planned sizes cannot save it
    short, _ = play(plan, SLOW, 12)
    assert short.stalls > 0
    # and a first chunk one block shorter than planned is not enough either: the planned one is the least that is
    assert play(plan, SLOW, first - 12)[0].stalls > 0


def test_a_fast_machine_keeps_the_short_first_chunk():
    plan = planner(FAST)
    assert plan.first(0.5, 12) == 12
    assert play(plan, FAST, 12)[0].stalls == 0
    assert plan.fit(0.5) == 96  # a full chunk lands within half a second


def test_a_larger_client_buffer_needs_less_first_audio():
    plan = planner(SLOW)
    assert plan.first(1.0, 12) == 12
    assert plan.first(0.0, 12) > plan.first(0.5, 12)


def test_the_margin_plans_for_slower_calls_than_estimated():
    assert planner(SLOW, margin=0.25).first(0.5, 12) > planner(SLOW).first(0.5, 12)
    assert planner(SLOW, margin=0.25).fit(1.0) < planner(SLOW).fit(1.0)


def test_a_machine_slower_than_real_time_keeps_the_early_first_audio():
    too_slow = (0.2, 0.03)  # 1.5x slower than real time per code: no lead keeps up
    plan = planner(too_slow)
    assert plan.first(0.5, 12) == 12
    assert not plan.keeps_playing(10.0)


def test_fit_is_the_largest_whole_block_chunk_that_lands_before_the_client_runs_dry():
    plan = planner(SLOW)
    assert plan.fit(0.2 + 0.0105 * (24 + 36) + 1e-9) == 36
    assert plan.fit(0.2 + 0.0105 * (24 + 36) - 1e-9) == 24
    assert plan.fit(0.1) == 0  # not one block lands in time
    assert plan.fit(100.0) == 96  # never above the cap


def test_the_wait_for_codes_still_to_come_counts_against_the_lead():
    plan = planner(SLOW)
    lead = 0.2 + 0.0105 * (24 + 60) + 1e-9  # a 60-code chunk lands in time if it starts now
    assert plan.fit(lead) == 60
    here = 36  # codes here beyond the chunk's start; the rest come at 50 a second (real time)
    waited = plan.fit(lead, ready_in=lambda codes: max(0, codes - here) / 50)
    assert waited == 36  # the codes here go at once: a longer chunk would wait for its codes and land too late
    assert plan.fit(lead, ready_in=lambda codes: 0.0) == 60  # all here: as without
    assert plan.fit(lead, ready_in=lambda codes: 0.2) == 36  # a wait for every size: the lead it leaves decides
    assert plan.fit(lead, ready_in=lambda codes: 10.0) == 0  # nothing starts in time


def test_nothing_is_planned_before_a_call_was_timed():
    plan = planner(SLOW, timed=False)
    assert plan.fit(1.0) is None
    assert plan.first(0.5, 12) == 12


@pytest.mark.parametrize("bad", [{"unit": 0}, {"cap": 6}, {"audio_per_code": 0}, {"margin": -1}])
def test_bad_plans_are_refused(bad):
    kw = {"call_s": lambda codes: 1.0, "audio_per_code": 0.02, "unit": 12, "cap": 96, "context_first": 12,
          "context_later": 24, **bad}
    with pytest.raises(ValueError, match="bad chunk plan"):
        ChunkPlanner(**kw)


def test_whether_a_lead_keeps_up_can_be_asked_with_calls_as_estimated():
    """The code2wav program gives up on a lead (sends a whole chunk) only when even calls as estimated cannot keep
    its client playing; the planner's margin makes the chunks it sends safe, not that judgement pessimistic."""
    plan = planner(SLOW, margin=0.25)
    assert not plan.keeps_playing(1.0)  # with calls 25% longer, 1 s of lead runs out ...
    assert plan.keeps_playing(1.0, margin=0.0)  # ... with calls as estimated it is above the 0.95 s that keeps up
    assert not plan.keeps_playing(0.9, margin=0.0)


def test_a_talker_barely_faster_than_real_time_gets_a_longer_first_chunk():
    """A chat reply's talker shares the CPU with the thinker: its codes come at 1.15x real time (57.5 a second),
    so every later chunk waits for its codes and the lead grows only by what the talker gains on real time. The
    first chunk planned for a talker far ahead leaves the client dry a few chunks in; the one planned with the
    arrivals never does, and is the least that does not."""
    plan, rate = planner(SLOW), 57.5
    arrivals = CodeArrivals(here=24, rate=rate, lookahead=12)
    first, ahead = plan.first(0.5, 12, arrivals=arrivals), plan.first(0.5, 12)
    assert first > ahead == 24
    assert play(plan, SLOW, first, rate=rate)[0].stalls == 0
    assert play(plan, SLOW, ahead, rate=rate)[0].stalls > 0
    assert play(plan, SLOW, first - 12, rate=rate)[0].stalls > 0
    # a talker far ahead of real time: the first chunk planned without arrivals
    assert plan.first(0.5, 12, arrivals=CodeArrivals(here=24, rate=5000, lookahead=12)) == ahead
    # a talker slower than real time: no first chunk keeps its client playing, and the first audio stays early
    slower = CodeArrivals(here=24, rate=45, lookahead=12)
    assert plan.first(0.5, 12, arrivals=slower) == 12
    assert not plan.keeps_playing(5.0, arrivals=slower, sent=24)
    # ... even with many of its codes here already: full chunks gain lead only until those run out
    piled = CodeArrivals(here=200, rate=45, lookahead=12)
    assert not plan.keeps_playing(5.0, arrivals=piled, sent=24) and plan.first(0.5, 12, arrivals=piled) == 12


def test_opening_rates_are_the_median_of_the_recent_ones():
    rates = OpeningRates(keep=3)
    assert rates.median() is None
    for rate in (80.0, 50.0, 60.0, 200.0):
        rates.add(rate)
    assert rates.rates == [50.0, 60.0, 200.0] and rates.median() == 60.0
