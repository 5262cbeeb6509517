"""Deadline scheduling (omni_serve.engines.deadlines) and the batch engine driven by it with fake programs: the
cost model, which work runs now and which waits, the order of a tick's calls, and the deadlines an audio stream's
client sets (no Ray, no model)."""

from __future__ import annotations

import asyncio

import pytest

from omni_serve.engines.batch import BatchEngine, BatchProgram
from omni_serve.engines.deadlines import CostModel, Ready, call_budget, choose_by_deadline, fit_to_budget
from omni_serve.engines.loop import Slot
from omni_serve.playback import StreamDeadline
from tests.unit.test_autoscaling import FakeClock


def test_the_cost_model_learns_a_fixed_and_a_per_unit_cost():
    cost = CostModel(decay=1.0)
    assert cost.estimate(10) is None
    cost.add(10, 1.1)
    assert cost.estimate(20) == pytest.approx(2.2)  # one size seen: cost per unit only
    cost.add(20, 1.2)
    cost.add(30, 1.3)
    fixed, per_unit = cost.coefficients()
    assert fixed == pytest.approx(1.0) and per_unit == pytest.approx(0.01)
    assert cost.estimate(100) == pytest.approx(2.0)
    cost.add(5, 0.0)  # a fit whose fixed cost would be negative falls back to a cost per unit
    assert min(cost.coefficients()) >= 0


def _cost(fixed: float, per_unit: float) -> CostModel:
    cost = CostModel(decay=1.0)
    cost.add(0, fixed)
    cost.add(100, fixed + 100 * per_unit)
    return cost


def test_work_without_deadlines_or_a_cost_yet_is_all_taken():
    items = [Ready("a", None, 100), Ready("b", None, 1)]
    assert choose_by_deadline(items, 0.0, _cost(0.1, 0.01)) == items
    timed = [Ready("a", 0.1, 100), Ready("b", 5.0, 100)]
    assert choose_by_deadline(timed, 0.0, CostModel()) == timed  # nothing timed yet: nothing to decide on


def test_work_that_has_time_waits_while_work_about_to_be_late_goes_first():
    cost = _cost(0.1, 0.01)  # a call: 0.1 s + 0.01 s per unit
    buffered = Ready("buffered", 5.0, 100)  # seconds of audio buffered at its client
    first = Ready("first", 0.5, 10)  # waiting for its first audio
    dry = Ready("dry", 0.6, 10)  # its client's buffer runs dry soon
    chosen = choose_by_deadline([buffered, first, dry], 0.0, cost)
    assert [r.item for r in chosen] == ["first", "dry"]  # 0.3 s for both; 1.3 s with the buffered one
    # with no pressure everything is batched
    assert len(choose_by_deadline([Ready("a", 5.0, 10), Ready("b", 6.0, 100)], 0.0, cost)) == 2


def test_work_that_waiting_would_make_late_joins_the_urgent_call():
    cost = _cost(0.1, 0.01)
    late = Ready("late", 0.1, 10)  # 0.2 s alone: late already
    next_due = Ready("next", 0.3, 10)  # waiting: done at 0.4 (late); joining: 0.3 (on time)
    far = Ready("far", 3.0, 10)
    assert [r.item for r in choose_by_deadline([far, next_due, late], 0.0, cost)] == ["late", "next"]


def test_a_call_may_run_until_the_first_deadline_of_the_work_left_out_less_that_works_own_call():
    cost = _cost(0.1, 0.01)
    waiting = Ready("ramping", 1.0, 50, least=20)  # its own shortest call: 0.1 + 0.2 = 0.3 s, so it starts by 0.7
    assert call_budget([waiting], 0.0, cost) == pytest.approx((0.7 - 0.1) / 0.01)  # this call: 0.1 s + 60 units
    assert call_budget([waiting, Ready("calm", 9.0, 50)], 0.0, cost) == pytest.approx(60)
    # nothing bounds it: no deadlines, no cost timed yet, or only work that cannot be on time any more
    assert call_budget([Ready("plain", None, 5)], 0.0, cost) is None
    assert call_budget([waiting], 0.0, CostModel()) is None
    assert call_budget([Ready("dry", 0.2, 50, least=20)], 0.0, cost) is None  # needs 0.3 s from now: late anyway


def test_units_are_shortened_to_the_budget_most_urgent_first_but_never_below_their_least_size():
    urgent, next_one = Ready("urgent", 0.5, 100, least=20), Ready("next", 0.6, 100, least=20)
    plain = Ready("plain", 0.7, 30)  # cannot be shortened
    fitted = fit_to_budget([urgent, next_one, plain], 170)
    assert [r.item for r, _ in fitted] == ["urgent", "next", "plain"]
    assert [size for _, size in fitted] == [None, 40, None]  # 170 - 30 - 20*2 = 100 spare: urgent whole, next +20
    assert [size for _, size in fit_to_budget([urgent, next_one], 0)] == [20, 20]  # the batch stays whole
    assert [size for _, size in fit_to_budget([urgent], None)] == [None]


class _Timed(BatchProgram):
    def __init__(self, name: str, key: int, due: float | None, size: float = 10):
        self.name, self.key, self.due, self.size = name, key, due, size

    def ready(self):
        return not self.done

    def deadline(self):
        return self.due

    def work_size(self):
        return self.size

    def work(self):
        return (self.key,), self.name

    def complete(self, result):
        self.done = True
        return [result]


def _engine_with(programs: list[_Timed], cost: CostModel) -> tuple[BatchEngine, list[list[str]]]:
    calls: list[list[str]] = []
    engine = BatchEngine("code2wav", lambda names: calls.append(list(names)) or names, max_batch=8)
    engine.cost = cost
    loop = asyncio.new_event_loop()
    for p in programs:
        engine._slots[p.name] = Slot(p.name, p, loop, asyncio.Queue())
    return engine, calls


def test_the_batch_engine_computes_the_urgent_streams_first_and_the_buffered_one_in_a_later_call(monkeypatch):
    import omni_serve.engines.batch as batch

    monkeypatch.setattr(batch.time, "monotonic", lambda: 0.0)
    engine, calls = _engine_with([_Timed("buffered", 1, 5.0, 100), _Timed("first", 0, 0.5),
                                  _Timed("dry", 1, 0.6)], _cost(0.1, 0.01))
    engine.tick()
    assert calls == [["first"], ["dry"]]  # a group per key, the earliest deadline's first
    assert engine.load()["ready_waiting"] == 1.0  # the buffered stream waited
    engine.tick()
    assert calls[-1] == ["buffered"]


def test_without_pressure_groups_run_by_their_earliest_deadline_then_key(monkeypatch):
    import omni_serve.engines.batch as batch

    monkeypatch.setattr(batch.time, "monotonic", lambda: 0.0)
    engine, calls = _engine_with([_Timed("later", 0, 9.0), _Timed("sooner", 1, 5.0), _Timed("soon2", 1, 6.0)],
                                 _cost(0.001, 0.0))
    engine.tick()
    assert calls == [["sooner", "soon2"], ["later"]]
    plain, calls = _engine_with([_Timed("b", 1, None), _Timed("a", 0, None)], _cost(0.1, 0.01))
    plain.tick()
    assert calls == [["a"], ["b"]]  # no deadlines: key order, as ever


def test_a_streams_deadline_is_its_first_audio_target_then_when_its_clients_buffer_runs_dry():
    clock = FakeClock()
    pace = StreamDeadline(target_ttfp_s=1.0, buffer_s=0.5, clock=clock)
    assert pace.due() == pytest.approx(101.0)
    clock.t += 0.8
    pace.sent(0.24)
    assert pace.due() == pytest.approx(100.8 + 0.5 + 0.24)
    clock.t += 0.5
    pace.sent(2.0)
    assert pace.due() == pytest.approx(100.8 + 0.5 + 2.24)


class _Shortened(_Timed):
    """A unit that can be shortened to ``least`` (like a code2wav chunk cut to fewer blocks)."""

    def __init__(self, name, key, due, size, least, ready=True):
        super().__init__(name, key, due, size)
        self.least, self.is_ready, self.limits = least, ready, []

    def ready(self):
        return self.is_ready and not self.done

    def least_size(self):
        return self.least

    def limit(self, size):
        self.limits.append(size)
        self.size = size


def test_a_call_is_shortened_so_that_a_stream_still_waiting_for_input_is_not_kept_past_its_deadline(monkeypatch):
    import omni_serve.engines.batch as batch

    monkeypatch.setattr(batch.time, "monotonic", lambda: 0.0)
    long = _Shortened("long", 1, 3.0, 200, 20)  # 2.1 s whole: its client has 3 s of audio buffered
    ramping = _Shortened("ramping", 1, 1.0, 40, 20, ready=False)  # its input is coming; it must start by 0.7
    engine, calls = _engine_with([long, ramping], _cost(0.1, 0.01))
    engine.tick()
    assert calls == [["long"]] and long.limits == [pytest.approx(60)]  # 0.1 s + 60 units: ends at 0.7
    # without the ramping stream nothing bounds the call: the whole unit runs
    alone = _Shortened("alone", 1, 3.0, 200, 20)
    engine, calls = _engine_with([alone], _cost(0.1, 0.01))
    engine.tick()
    assert calls == [["alone"]] and alone.limits == []
