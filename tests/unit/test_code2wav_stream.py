"""Streaming code2wav: chunks with context concatenate to transformers' whole-sequence code2wav."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_serve.families.qwen2_5_omni.messages import CodecChunk
from omni_serve.families.qwen2_5_omni.replica.code2wav import (
    Code2WavCompute, Code2WavRequest, Code2WavStream, check_chunking,
)
from omni_serve.kits.omni.replica.chunk_plan import OpeningRates
from omni_serve.models.qwen2_5_omni import OmniCode2Wav

STEPS = 3


@pytest.fixture(scope="module")
def c2w(omni_tiny_dir):
    return OmniCode2Wav(omni_tiny_dir)


def codes(n: int, seed: int) -> list[int]:
    return torch.randint(0, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def stream_all(c2w, streams_codes, req_kw, feed=7, shortest=False):
    """Feed several streams ``feed`` codes at a time; every engine tick computes all ready ones as one batch
    (``shortest``: each chunk limited to its least size, as the batch engine does under the tightest budget)."""
    compute = Code2WavCompute(c2w, STEPS, 0.5, -1.0)
    streams = [Code2WavStream(c2w, Code2WavRequest("Chelsie", seed, STEPS, **req_kw)) for seed, _ in streams_codes]
    outs = [[] for _ in streams]
    fed = [0] * len(streams)
    batch_sizes = []
    with torch.inference_mode():
        while not all(s.done for s in streams):
            for i, (s, (_, cs)) in enumerate(zip(streams, streams_codes)):
                if fed[i] < len(cs):
                    s.feed(CodecChunk(codes=cs[fed[i]:fed[i] + feed], end=fed[i] + feed >= len(cs)))
                    fed[i] += feed
            groups = {}
            for i, s in enumerate(streams):
                if s.ready():
                    if shortest:
                        s.limit(s.least_size())
                    key, job = s.work()
                    groups.setdefault(key, []).append((i, job))
            for items in groups.values():
                batch_sizes.append(len(items))
                for (i, _), result in zip(items, compute([job for _, job in items])):
                    outs[i] += streams[i].complete(result)
    return outs, batch_sizes


@pytest.mark.parametrize("req_kw", [
    {"chunk_codes": 48},
    {"chunk_codes": 24, "left_context_codes": 0},
    {"first_chunk_codes": 24, "chunk_codes": 12, "left_context_codes": 24, "right_context_codes": 24},
    {"chunk_codes": 96, "chunk_growth": 2.0},  # 12, 24, 72, then the rest: growing chunks keep exact seams
])
def test_chunks_concatenate_to_whole_sequence(c2w, req_kw):
    cs = codes(101, 0)
    outs, _ = stream_all(c2w, [(7, cs)], req_kw)
    whole = c2w.synthesize(cs, "Chelsie", 7, num_steps=STEPS).numpy()
    wav = np.concatenate([o.audio for o in outs[0]])
    assert len(outs[0]) > 2, "not streamed in chunks"
    assert sum(o.num_codes for o in outs[0]) == len(cs)
    assert wav.shape == whole.shape
    np.testing.assert_allclose(wav, whole, rtol=0, atol=1e-4 * np.abs(whole).max())


def test_requests_batched_together_match_alone(c2w):
    pairs = [(7, codes(60, 1)), (8, codes(60, 2)), (9, codes(37, 3))]
    together, sizes = stream_all(c2w, pairs, {})
    assert max(sizes) > 1, "windows of different requests were never batched"
    for (seed, cs), outs in zip(pairs, together):
        alone, _ = stream_all(c2w, [(seed, cs)], {})
        np.testing.assert_allclose(np.concatenate([o.audio for o in outs]),
                                   np.concatenate([o.audio for o in alone[0]]), rtol=0, atol=1e-12)


def test_empty_speech_yields_one_empty_chunk(c2w):
    stream = Code2WavStream(c2w, Code2WavRequest("Chelsie", 0, STEPS))
    stream.close_input()
    assert stream.ready()
    key, job = stream.work()
    out = stream.complete(Code2WavCompute(c2w, STEPS, 0.5, -1.0)([job])[0])
    assert stream.done and out[0].num_codes == 0 and out[0].audio.size == 0


def test_chunking_must_follow_dit_blocks(c2w):
    with pytest.raises(ValueError, match="multiple of the DiT block"):
        check_chunking(c2w, Code2WavRequest("Chelsie", 0, chunk_codes=10))


def test_bfloat16_dit_blocks_stay_close_to_float32(c2w, omni_tiny_dir):
    """``dit_dtype=bfloat16`` runs the DiT's blocks on a bfloat16 copy: the mel stays within 1% of float32's, and
    is not float32's (the option is really on); transformers' own path (``synthesize``) keeps float32 weights. Its
    linear layers are prepacked where this CPU runs bfloat16 products (``omni_kernels.packing_supported``), else the
    plain library layers, and the stats record which."""
    from omni_kernels import PackedLinear, kernel_paths, packing_supported

    from omni_serve.models.qwen2_5_omni import DiTWindow

    low = OmniCode2Wav(omni_tiny_dir, dit_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    n = 4 * c2w.block_codes
    windows = [DiTWindow(codes=codes(n, s), noise=torch.randn(c2w.repeats * n, c2w.mel_dim, generator=g),
                         voice="Chelsie") for s in range(2)]
    want, got = (torch.stack(m.dit_windows(windows, num_steps=3)) for m in (c2w, low))
    err = float((got - want).abs().max() / want.abs().max())
    assert 0 < err < 1e-2, err
    assert all(p.dtype == torch.float32 for p in low.dit.parameters())
    assert low.prepared.dtype == torch.bfloat16
    packed = packing_supported(torch.bfloat16)
    assert isinstance(low.prepared.layers[0].qkv, PackedLinear) == packed
    assert isinstance(low.prepared.layers[0].up_gelu, PackedLinear) == packed
    assert kernel_paths()["linear.bfloat16"]["path"].startswith("prepacked" if packed else "F.linear")


def test_windows_of_different_lengths_in_one_call_equal_each_alone(c2w):
    """``dit_windows`` packs windows of any lengths (whole blocks or not) into one solve: each window's mel equals
    its solve alone, and a window solved with another's noise does not (the comparison can fail)."""
    from omni_serve.models.qwen2_5_omni import DiTWindow

    g = torch.Generator().manual_seed(1)
    lengths = [c2w.block_codes * 4, 37, c2w.block_codes, 5, 37]  # a run of two equally long windows
    windows = [DiTWindow(codes=codes(n, s), noise=torch.randn(c2w.repeats * n, c2w.mel_dim, generator=g),
                         voice=voice) for s, (n, voice) in enumerate(zip(lengths, ["Chelsie", "Ethan"] * 3))]
    together = c2w.dit_windows(windows, num_steps=STEPS)
    assert [m.shape[1] for m in together] == [c2w.repeats * n for n in lengths]
    for w, got in zip(windows, together):
        alone = c2w.dit_windows([w], num_steps=STEPS)[0]
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-6 * float(alone.abs().max()))  # bit-equal here
    other = DiTWindow(windows[1].codes, torch.randn(windows[1].noise.shape, generator=g), windows[1].voice)
    swapped = c2w.dit_windows([other], num_steps=STEPS)[0]
    assert float((swapped - together[1]).abs().max()) > 1e-2 * float(together[1].abs().max())


def test_time_conditioning_kept_per_time_value_serves_any_step_schedule(c2w, omni_tiny_dir):
    """The DiT keeps each ODE time's conditioning: solves with another number of steps after it (other time values)
    equal a fresh model's, and the kept values change the result when the schedule changes (not a constant)."""
    from omni_serve.models.qwen2_5_omni import DiTWindow

    g = torch.Generator().manual_seed(2)
    n = 2 * c2w.block_codes
    window = DiTWindow(codes=codes(n, 5), noise=torch.randn(c2w.repeats * n, c2w.mel_dim, generator=g),
                       voice="Chelsie")
    c2w.dit_windows([window], num_steps=STEPS)
    fresh = OmniCode2Wav(omni_tiny_dir)
    for steps in (STEPS + 2, STEPS):
        torch.testing.assert_close(c2w.dit_windows([window], num_steps=steps)[0],
                                   fresh.dit_windows([window], num_steps=steps)[0], rtol=0, atol=0)
    assert not torch.equal(c2w.dit_windows([window], num_steps=STEPS + 2)[0],
                           c2w.dit_windows([window], num_steps=STEPS)[0])


def test_chunks_grow_with_the_audio_sent_up_to_chunk_codes(c2w):
    outs, _ = stream_all(c2w, [(7, codes(301, 4))], {"chunk_codes": 96, "chunk_growth": 2.0})
    assert [o.num_codes for o in outs[0]] == [12, 24, 72, 96, 96, 1]
    fixed, _ = stream_all(c2w, [(7, codes(301, 4))], {"chunk_codes": 96})
    assert [o.num_codes for o in fixed[0]] == [12, 96, 96, 96, 1]


def test_a_chunk_is_cut_to_the_codes_here_when_its_client_is_about_to_run_dry(c2w):
    from omni_serve.playback import StreamDeadline
    from tests.unit.test_autoscaling import FakeClock

    clock = FakeClock()
    stream = Code2WavStream(c2w, Code2WavRequest("Chelsie", 7, STEPS, chunk_codes=96, cut_lead_s=0.4))
    stream.pace = StreamDeadline(target_ttfp_s=1.0, buffer_s=0.5, clock=clock)
    cs = codes(200, 5)
    compute = Code2WavCompute(c2w, STEPS, 0.5, -1.0)

    def run_one():
        _, job = stream.work()
        return stream.complete(compute([job])[0])

    with torch.inference_mode():
        stream.feed(CodecChunk(codes=cs[:24], end=False))
        assert [o.num_codes for o in run_one()] == [12]  # sent at 100.0: the client runs dry at 100.74
        stream.feed(CodecChunk(codes=cs[24:60], end=False))
        clock.t += 0.2
        assert not stream.ready()  # 0.54 s left: it waits for the whole chunk (96 codes)
        clock.t += 0.2
        assert stream.ready()  # 0.34 s left: the 36 codes with their right context go now
        assert [o.num_codes for o in run_one()] == [36]
        clock.t += 5  # dry already: the next chunk waits for its whole size
        stream.feed(CodecChunk(codes=cs[60:100], end=False))
        assert not stream.ready()


def test_chunks_limited_by_the_engine_are_whole_blocks_and_keep_exact_seams(c2w):
    cs = codes(101, 0)
    unit = c2w.block_codes
    outs, _ = stream_all(c2w, [(7, cs)], {"chunk_codes": 96, "chunk_growth": 2.0}, shortest=True)
    assert [o.num_codes for o in outs[0][:-1]] == [unit] * (len(outs[0]) - 1)  # one block each, the rest last
    whole = c2w.synthesize(cs, "Chelsie", 7, num_steps=STEPS).numpy()
    wav = np.concatenate([o.audio for o in outs[0]])
    np.testing.assert_allclose(wav, whole, rtol=0, atol=1e-4 * np.abs(whole).max())
    # limit(size) takes the most whole blocks whose window fits size; work_size() then says so
    stream = Code2WavStream(c2w, Code2WavRequest("Chelsie", 7, STEPS, chunk_codes=96, chunk_growth=2.0))
    stream.feed(CodecChunk(codes=cs, end=False))
    stream.start = 24  # as if two chunks were sent: the next is 48 codes, with 12 each side
    rep = c2w.repeats
    assert stream.work_size() == (12 + 48 + 12) * rep
    stream.limit((12 + 2 * unit + 12) * rep + rep)  # room for two blocks, not three
    assert stream.work_size() == (12 + 2 * unit + 12) * rep
    assert stream.least_size() == (12 + unit + 12) * rep


class _Planned:
    """A stream planned by a slow machine's cost model (0.2 s a call + 0.0105 s a window code: code2wav on one core
    of machine E), its client paced by ``clock`` (0.5 s buffer), and what ``run_one`` emitted."""

    def __init__(self, c2w, clock, openings=None):
        from omni_serve.engines.deadlines import CostModel
        from omni_serve.playback import StreamDeadline

        slow = CostModel()
        for frames in (48, 240):
            slow.add(frames, 0.2 + 0.0105 * frames / c2w.repeats)
        self.stream = Code2WavStream(c2w, Code2WavRequest("Chelsie", 7, STEPS, chunk_codes=96, chunk_growth=2.0,
                                                          plan_margin=0.0))
        self.stream.pace = StreamDeadline(target_ttfp_s=1.0, buffer_s=0.5, clock=clock)
        self.stream.plan_with(slow, openings)
        self.compute = Code2WavCompute(c2w, STEPS, 0.5, -1.0)
        self.out = []

    def run_one(self) -> list[int]:
        _, job = self.stream.work()
        got = self.stream.complete(self.compute([job])[0])
        self.out.extend(got)
        return [o.num_codes for o in got]

    def arrive(self, cs: list[int], clock) -> None:
        """``cs`` in 12-code chunks, evenly over the 0.72 s before ``clock``'s 100.0 (where it is left)."""
        steps = len(cs) // 12 - 1
        clock.t = 100.0 - 0.72
        self.stream.feed(CodecChunk(codes=cs[:12], end=False))
        for i in range(1, steps + 1):
            clock.t = 100.0 - 0.72 + 0.72 * i / steps
            self.stream.feed(CodecChunk(codes=cs[12 * i:12 * i + 12], end=False))

    def assert_exact(self, c2w, cs) -> None:
        whole = c2w.synthesize(cs, "Chelsie", 7, num_steps=STEPS).numpy()
        np.testing.assert_allclose(np.concatenate([o.audio for o in self.out]), whole, rtol=0,
                                   atol=1e-4 * np.abs(whole).max())


def test_planned_chunks_follow_the_machine_s_cost_and_keep_exact_seams(c2w):
    from omni_serve.engines.deadlines import CostModel
    from omni_serve.playback import StreamDeadline
    from tests.unit.test_autoscaling import FakeClock

    rep = c2w.repeats
    clock = FakeClock()
    planned = _Planned(c2w, clock)
    stream, run_one = planned.stream, planned.run_one
    cs = codes(240, 5)
    with torch.inference_mode():
        stream.feed(CodecChunk(codes=cs[:24], end=False))
        assert not stream.ready()  # 12 codes first would leave its client dry on this machine: it waits for 24
        stream.feed(CodecChunk(codes=cs[24:36], end=False))
        assert run_one() == [24]  # sent at 100.0: 0.98 s of lead (0.5 s buffer + 0.48 s)
        stream.feed(CodecChunk(codes=cs[36:240], end=False))
        assert run_one() == [48]  # the most whole blocks whose call (72 codes' window) lands within 0.98 s
        clock.t += 0.9  # 1.04 s of lead left (the client runs dry at 101.94): 48 codes (a 72-code window) land
        assert run_one() == [48]
        clock.t += 1.2  # 0.8 s left (dry at 102.9): 36 codes land in time, but no chunk that lands in time keeps
        assert stream.ready() and run_one() == [96]  # up from a lead that low: a whole chunk, to stall once, not
        # again and again
        stream.feed(CodecChunk(codes=[], end=True))
        while not stream.done:
            run_one()
    planned.assert_exact(c2w, cs)
    # a fast machine keeps the short first chunk
    fast = CostModel()
    for frames in (48, 240):
        fast.add(frames, 0.02 + 0.001 * frames / rep)
    quick = Code2WavStream(c2w, Code2WavRequest("Chelsie", 7, STEPS, chunk_codes=96, chunk_growth=2.0))
    quick.pace = StreamDeadline(target_ttfp_s=1.0, buffer_s=0.5, clock=clock)
    quick.plan_with(fast)
    quick.feed(CodecChunk(codes=cs[:24], end=False))
    assert quick.ready() and quick.work_size() == 24 * rep
    # a talker whose first codes came at 1.15x real time (its rate on the first chunk): every later chunk will wait
    # for its codes, so the slow machine's stream waits for a longer first chunk than the 24 codes above
    talking = _Planned(c2w, clock).stream
    talking.feed(CodecChunk(codes=cs[:24], end=False, codes_per_s=57.5))
    talking.feed(CodecChunk(codes=cs[24:36], end=False))
    assert not talking.ready()
    talking.feed(CodecChunk(codes=cs[36:48], end=False))
    assert talking.ready() and talking.work_size() == (36 + 12) * rep  # 36 codes and their right context
    # a talker that reports 500 codes a second, on a replica whose recent openings came at 1.15x real time: the
    # lower rate is planned for (a talker slows once code2wav shares the cores with it)
    openings = OpeningRates()
    openings.add(57.5)
    recent = _Planned(c2w, clock, openings).stream
    recent.feed(CodecChunk(codes=cs[:36], end=False, codes_per_s=500.0))
    assert not recent.ready()
    recent.feed(CodecChunk(codes=cs[36:48], end=False))
    assert recent.ready() and recent.work_size() == (36 + 12) * rep


def test_a_stream_adds_the_rate_of_its_opening_to_its_replica_s(c2w):
    """The rate codes came at from the first chunk until 96 more came, once per stream."""
    from tests.unit.test_autoscaling import FakeClock

    clock, openings = FakeClock(), OpeningRates()
    planned = _Planned(c2w, clock, openings)
    cs = codes(240, 5)
    with torch.inference_mode():
        planned.stream.feed(CodecChunk(codes=cs[:48], end=False))
        assert planned.run_one() == [24]  # at 100.0
        clock.t += 0.6
        planned.stream.feed(CodecChunk(codes=cs[48:96], end=False))
        assert openings.median() is None  # 48 codes since: not yet
        clock.t += 0.6
        planned.stream.feed(CodecChunk(codes=cs[96:144], end=False))
        assert openings.rates == [pytest.approx(96 / 1.2)]
        clock.t += 0.1
        planned.stream.feed(CodecChunk(codes=cs[144:240], end=True))
        assert openings.rates == [pytest.approx(96 / 1.2)]  # once


def _ramped(c2w) -> tuple["_Planned", list[int]]:
    """A planned stream whose first 72 codes came from 99.28 to 100.0 (83 a second) and whose 24-code first chunk
    went at 100.0 (0.98 s of lead: 0.5 s buffer + 0.48 s); and its 120 codes."""
    from tests.unit.test_autoscaling import FakeClock

    clock = FakeClock()
    planned = _Planned(c2w, clock)
    cs = codes(120, 5)
    planned.arrive(cs[:72], clock)
    with torch.inference_mode():
        assert planned.run_one() == [24]
    return planned, cs


def _finish(planned: "_Planned", c2w, cs: list[int]) -> None:
    stream = planned.stream
    with torch.inference_mode():
        stream.feed(CodecChunk(codes=cs[72:], end=True))
        while not stream.done:
            planned.run_one()
    planned.assert_exact(c2w, cs)


def test_a_planned_chunk_of_the_codes_here_goes_at_once_when_more_would_come_too_late(c2w):
    """Codes that come at their measured rate: the next chunk the lead allows with every code here (48) would wait
    for 12 more codes and land too late, so the 36 here go at once; the seams stay exact."""
    planned, cs = _ramped(c2w)
    stream = planned.stream
    assert stream._codes_in(48) == pytest.approx(12 / (60 / 0.72))
    assert stream.planner.keeps_playing(0.98, margin=0.0)  # the lead can keep up: a chunk may be cut to fit
    # 48 codes (a 72-code window, 0.956 s) would land in time had they all come; 36 (0.83 s) are here
    with torch.inference_mode():
        assert stream.ready() and planned.run_one() == [36]
    _finish(planned, c2w, cs)


def test_a_chunk_that_grew_after_ready_looked_keeps_its_right_context(c2w):
    """ready() sees a chunk of the codes here; time passes before work() (the lead falls below what chunks that land
    in time can keep up from, so the plan turns to a whole chunk whose codes have not come): work() still takes only
    the blocks whose right context is here, and the seams stay exact."""
    planned, cs = _ramped(c2w)
    stream = planned.stream
    assert stream.ready() and stream._chunk_end() == 24 + 36  # the codes here
    stream.pace.clock.t += 0.2  # 0.78 s of lead: no chunk that lands in time keeps up from here
    assert not stream.planner.keeps_playing(stream.pace.slack(), margin=0.0)
    assert stream._chunk_end() == 24 + 48  # the whole chunk, whose last codes and context have not come
    with torch.inference_mode():
        assert planned.run_one() == [36]  # 24 + 36 + 12 of right context: here
    _finish(planned, c2w, cs)


def test_the_code2wav_replica_times_its_calls_before_the_first_stream(omni_tiny_dir):
    """With ``plan_chunks`` (the default) the replica's engine starts with a cost model (a first-chunk and a
    full-chunk call, timed), so its first stream's chunks are planned too; without it, none is timed."""
    from omni_serve.families.qwen2_5_omni import FAMILY
    from omni_serve.graph.runner import build_runner

    runner = build_runner(FAMILY, "code2wav", {"checkpoint": omni_tiny_dir,
                                               "stages": {"code2wav": {"params": {"num_steps": STEPS}}}})
    fixed, per_frame = runner.make_engine().cost.coefficients()  # the engine's worker starts with its first request
    assert fixed >= 0 and per_frame > 0  # two sizes timed: a cost per frame of window
    off = build_runner(FAMILY, "code2wav", {"checkpoint": omni_tiny_dir, "stages": {"code2wav": {"params": {
        "num_steps": STEPS, "plan_chunks": False}}}})
    assert off.make_engine().cost.coefficients() is None
