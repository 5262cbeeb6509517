"""Talker pacing: ``TalkerLead``'s bound on a played stream's lead, and the AR engine's scheduling of sequences that
are due, ride along or hold (``ARSequence.pace``) on a fake model (the wiring), and a paced reply on the real tiny
Qwen2.5-Omni graph in-process (``tests/omni_inprocess.py``: its runners and engines, no Ray)."""

from __future__ import annotations

import types

import numpy as np

import pytest
import torch

from omni_serve.engines.ar import ARConfig, AREngine
from omni_serve.engines.ar.sequence import ARSequence, Pace
from omni_serve.engines.loop import Slot
from omni_serve.kits.omni.replica.streams import StreamedSequence, TalkerLead, talker_lead


def test_the_lead_is_the_codes_sent_less_the_time_since_the_first():
    lead = TalkerLead(lead_s=2.0, codes_per_s=50)
    assert lead.pace(100.0) is Pace.DUE and lead.ahead_s(100.0) == 0  # nothing sent: due
    lead.sent(0, 99.0)
    assert lead.since is None  # an empty chunk starts no clock
    lead.sent(100, 100.0)  # 2 s of audio at t=100
    assert lead.ahead_s(100.0) == pytest.approx(2.0) and lead.pace(100.0) is Pace.RIDE
    assert lead.pace(100.5) is Pace.DUE  # 1.5 s ahead: below the lead
    lead.sent(150, 100.5)  # 5 s sent, 0.5 s played at most
    assert lead.ahead_s(100.5) == pytest.approx(4.5) and lead.pace(100.5) is Pace.HOLD
    assert lead.pace(101.5) is Pace.RIDE  # 3.5 s ahead: no step of its own, but joins one
    assert lead.pace(103.5) is Pace.DUE


def test_only_a_played_stream_with_the_setting_on_is_paced():
    spec = types.SimpleNamespace(playback=types.SimpleNamespace(talker_lead_s=3.0))
    assert isinstance(talker_lead(spec, True, 50.0), TalkerLead)
    assert talker_lead(spec, False, 50.0) is None  # not streamed: as fast as it can
    spec.playback.talker_lead_s = None
    assert talker_lead(spec, True, 50.0) is None


def test_a_streamed_sequence_paces_by_what_it_sent():
    class Talker(StreamedSequence):
        def on_computed(self, start, end, hidden, logits):
            return []

    seq = Talker(4, 1)
    assert seq.pace(0.0) is Pace.DUE  # no lead: never paced
    seq.codes_sent(10)
    seq.lead = TalkerLead(lead_s=1.0, codes_per_s=10)
    seq.codes_sent(100)  # 10 s ahead of a client that cannot have started before now
    assert seq.pace(seq.lead.since) is Pace.HOLD


class _Model:
    """The ARModel protocol with no weights: every step's logits are zeros."""

    num_layers, num_kv_heads, head_dim, dtype, device, modules = 1, 1, 2, torch.float32, "cpu", {}

    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        return None, torch.zeros(len(logit_rows), 3)


class _Scripted(ARSequence):
    """Decodes up to ``max_rows`` rows, one per step, at the pace the test sets."""

    def __init__(self, max_rows=16):
        super().__init__(4, 1)
        self.max_rows = max_rows
        self.next_pace = Pace.DUE
        self._row()

    def _row(self):
        self.append(torch.zeros(1, 4), torch.full((1, 1), self.num_rows, dtype=torch.long))

    def pace(self, now):
        return self.next_pace

    def on_computed(self, start, end, hidden, logits):
        if logits is not None and self.num_rows < self.max_rows:
            self._row()
        return []


def _engine(num_kv_blocks=32, block_size=4):
    e = AREngine("talker", _Model(), ARConfig(packed_linear=False, decode_kv_copy_mib=0, num_kv_blocks=num_kv_blocks,
                                              block_size=block_size, prepared_layers=False))
    e.emit = lambda slot, outputs: None
    return e


@pytest.fixture
def engine():
    return _engine()


def _start(engine, names, max_rows=16):
    seqs = {n: _Scripted(max_rows) for n in names}
    for n, seq in seqs.items():
        slot = Slot(n, seq, None, None)
        engine._known.add(n)
        engine.waiting.append(slot)
    engine._execute(engine._schedule())  # all due: admitted and stepped once
    assert [s.request_id for s in engine.running] == list(names)
    return seqs


def _planned(engine) -> list[str]:
    plan = engine._schedule()
    if plan:  # the worker runs no step for an empty plan
        engine._execute(plan)
    return [w.slot.request_id for w in plan]


def test_riders_join_a_step_that_due_rows_make_run_and_holders_wait(engine):
    seqs = _start(engine, "abc")
    seqs["b"].next_pace, seqs["c"].next_pace = Pace.RIDE, Pace.HOLD
    assert _planned(engine) == ["a", "b"]
    assert engine.stats()["paced_waits"] == 1  # c was left out
    seqs["a"].next_pace = Pace.HOLD
    assert _planned(engine) == []  # a rider alone runs no step
    assert engine.stats()["paced_waits"] == 2
    seqs["c"].next_pace = Pace.DUE
    assert _planned(engine) == ["c", "b"]  # due first, riders after, in admission order
    seqs["b"].next_pace = Pace.DUE
    assert _planned(engine) == ["b", "c"]


def test_a_new_request_makes_riders_step_with_it(engine):
    seqs = _start(engine, "a")
    seqs["a"].next_pace = Pace.RIDE
    assert _planned(engine) == []
    engine._known.add("new")
    engine.waiting.append(Slot("new", _Scripted(), None, None))
    assert _planned(engine) == ["new", "a"]


def test_riders_fit_in_the_step_budget_left(engine):
    seqs = _start(engine, "ab")
    engine.config.max_batch_tokens = 1
    seqs["a"].next_pace = Pace.RIDE
    assert _planned(engine) == ["b"]  # no budget left for the rider


def test_a_paced_talker_speaks_exactly_what_an_unpaced_one_does(omni_tiny_dir):
    """The real graph in-process (tiny Qwen2.5-Omni): a reply its client plays, paced at a lead far below its
    0.8 s of audio, waits in the talker's schedule and gives the same codes and waveform as the reply made as fast
    as the talker goes (codes exactly; the waveform to float rounding)."""
    import asyncio

    from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
    from tests.omni_cases import template_messages
    from tests.omni_inprocess import InProcessOmni

    x = OmniInputProcessor(omni_tiny_dir)(*template_messages("text"))

    async def main():
        omni = InProcessOmni(omni_tiny_dir, talker_tokens=40, overrides={"playback.talker_lead_s": 0.05})
        try:
            fast = await omni.run("fast", x, 6, seed=3)
            waits = omni.talker.stats()["paced_waits"]
            paced = await omni.run("paced", x, 6, seed=3, paced=True)
            return fast, paced, waits, omni.talker.stats()["paced_waits"]
        finally:
            await omni.close()

    fast, paced, fast_waits, paced_waits = asyncio.run(main())
    assert len(fast.codes) == 40 and fast_waits == 0
    assert paced_waits > 0  # it was held or rode along
    assert paced.tokens == fast.tokens and paced.codes == fast.codes
    # code2wav may cut the chunks elsewhere (its chunk plan follows their timing): exact seams, float rounding
    scale = float(np.abs(fast.wav).max())
    assert paced.wav.shape == fast.wav.shape and scale > 0
    np.testing.assert_allclose(paced.wav, fast.wav, rtol=1e-4, atol=scale * 1e-5)


def test_a_full_cache_preempts_a_stream_that_is_ahead_and_riders_never_preempt():
    engine = _engine(num_kv_blocks=4, block_size=1)  # a block per row: three 1-row prompts leave one free
    seqs = _start(engine, "abc", max_rows=4)
    seqs["b"].next_pace = Pace.HOLD
    # a takes the last block; c, due, needs one: b is ahead, so b gives its blocks back, not c (the newest)
    assert _planned(engine) == ["a", "c"]
    assert [s.request_id for s in engine.waiting] == ["b"] and engine.stats()["preemptions"] == 1
    assert engine.backlog() > 0  # a preempted sequence is due again whatever its pace: its rows are gone
    seqs["a"].next_pace = seqs["c"].next_pace = Pace.RIDE
    assert _planned(engine) == []  # b is not readmitted: no free block above the watermark
    assert engine.stats()["preemptions"] == 1  # and riders never preempt


def test_a_rider_without_a_free_block_is_left_out():
    engine = _engine(num_kv_blocks=3, block_size=1)
    seqs = _start(engine, "ab", max_rows=3)
    seqs["b"].next_pace = Pace.RIDE
    assert _planned(engine) == ["a"]  # a takes the last block; b would need one
    assert [s.request_id for s in engine.running] == ["a", "b"] and engine.stats()["preemptions"] == 0
