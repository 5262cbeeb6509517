"""Streaming code2wav: codec tokens to audio chunk by chunk, batched across requests, seams matching.

Contract: ``Code2WavStream`` (a ``BatchProgram``) takes ``CodecChunk``s and emits a ``WaveChunk`` (float32
samples, codes they cover) per synthesized chunk, in order; the concatenation equals a
whole-sequence ``Qwen2_5OmniToken2WavModel`` call on all the codes (same seed) within float tolerance.
``Code2WavCompute(model, params)`` is the engine's batched ``compute``.

How the seams match:
- DiT: chunk ``[s, e)`` (codes) is solved as the window ``[s - left, e + right)``: the DiT attends only within
  ``block_size``-frame blocks and their neighbours, so with a block of context on each side the chunk's mel
  equals the whole-sequence mel (measured max |diff| ~5e-7 on the small checkpoint; 1e-4 with none).
  Windows start on block boundaries, and the initial noise of each window is the slice of the request's
  whole-sequence noise (drawn incrementally from a generator seeded like transformers' global RNG), so
  the ODE sees exactly the inputs the whole-sequence solve sees.
- Vocoder: each chunk's mel is vocoded with ``vocoder_context_frames`` of already-final mel on the left and
  of the window's look-ahead mel on the right, and the output trimmed to the chunk's samples.
The chunk waits for ``right`` codes beyond its end (or the end of the stream), which is the price of exact
seams: a few codec frames (12 codes = 0.24 s of audio by default) of extra latency. With ``chunk_growth``, chunks
after the first grow with the audio already sent (12, 24, 72, 96 codes by the stage's defaults), so the second
chunk comes before a client playing the short first one runs dry; the seams are exact whatever the sizes. A stream
with a ``pace`` (its client's deadlines) cuts a later chunk short, to the whole blocks of codes it has, once its
client is within ``cut_lead_s`` of running dry, and the batch engine shortens a chunk (``limit``, whole blocks) when
its whole length would keep another stream's client waiting past its deadline. With the engine's cost model
(``plan_with``), chunk sizes also follow what the machine can do (``omni_serve.kits.omni.replica.chunk_plan``): the
first chunk is as long as the client needs to never run dry afterwards, later chunks waiting for codes that come at
the rate the talker reported with the first ones or, if lower, the median rate of the replica's recent streams'
openings (the short first chunk where the machine and the talker are fast enough), and a later chunk no longer
than lands before its client runs dry, counting the wait for codes still to come at the rate the stream's codes
have come so far (a chunk of the codes here then goes at once instead of a longer one that would start too late).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from omni_serve.engines.batch import BatchProgram
from omni_serve.engines.deadlines import CostModel
from omni_serve.families.qwen2_5_omni.messages import CodecChunk
from omni_serve.kits.omni.replica.chunk_plan import ChunkPlanner, CodeArrivals, OpeningRates
from omni_serve.kits.omni.replica.streams import PacedAudio, StreamedInput, WaveChunk
from omni_serve.models.qwen2_5_omni import DiTWindow, OmniCode2Wav


@dataclass
class Code2WavRequest:
    voice: str
    seed: int
    num_steps: int = 10
    guidance_scale: float = 0.5
    sway_coefficient: float = -1.0
    first_chunk_codes: int = 12
    chunk_codes: int = 96
    chunk_growth: float = 0.0  # a later chunk is at most this times the codes sent (whole blocks); 0: chunk_codes
    cut_lead_s: float = 0.4  # with a pace: a later chunk is cut to the codes here this long before its client runs dry
    plan_margin: float = 0.3  # with a pace and a cost model (plan_with): calls planned this much longer than estimated
    left_context_codes: int = 12
    right_context_codes: int = 12
    vocoder_context_frames: int = 8


@dataclass
class _Job:
    window: DiTWindow
    keep: tuple[int, int]  # frames of the window that are this chunk
    mel_left: torch.Tensor  # [mel, <= context] final mel before the chunk
    context: int
    codes: int


def check_chunking(model: OmniCode2Wav, req: Code2WavRequest) -> None:
    """Chunk starts and left contexts must be whole DiT blocks, or windows would not line up with blocks."""
    unit = model.block_codes
    for name in ("first_chunk_codes", "chunk_codes", "left_context_codes", "right_context_codes"):
        value = getattr(req, name)
        if value < 0 or value % unit or (value == 0 and name.endswith("chunk_codes")):
            raise ValueError(f"code2wav {name}={value} must be a positive multiple of the DiT block "
                             f"({unit} codes = block_size / repeats) (contexts may be 0)")


class Code2WavStream(PacedAudio, StreamedInput, BatchProgram):
    def __init__(self, model: OmniCode2Wav, req: Code2WavRequest):
        self.model, self.req = model, req
        self.codes: list[int] = []
        self.start = 0  # codes whose audio was emitted
        self.generator = torch.Generator().manual_seed(req.seed)
        self.noise = torch.empty(0, model.mel_dim)
        self.mel_tail = torch.empty(model.mel_dim, 0)
        self.emitted = False
        self.done = False
        self._pending_end = 0
        self._limit_codes: int | None = None  # the next chunk's most codes (``limit``), for one ``work()``
        self.planner: ChunkPlanner | None = None
        self._first_codes: int | None = None  # the planned first chunk (None: not planned yet)
        self._arrivals: tuple[float, int] | None = None  # (time by _now, codes) of the first codes that came
        self._producer_rate: float | None = None  # the talker's codes per second when it sent the first codes
        self.openings: OpeningRates | None = None  # the replica's recent streams' opening rates (plan_with)
        self._opening: tuple[float, int] | None = None  # (time, codes here) as the first chunk went; None: measured

    def plan_with(self, cost: CostModel, openings: OpeningRates | None = None) -> None:
        """Size chunks by what the engine's calls cost (``cost``: seconds per mel frame solved), the pace, and the
        rate codes came at in recent streams' openings (``openings``, which this stream adds its own to)."""
        self.openings = openings
        r, model = self.req, self.model
        self.planner = ChunkPlanner(
            lambda codes: cost.estimate(codes * model.repeats), model.samples_per_code / self.sample_rate,
            model.block_codes, r.chunk_codes, r.right_context_codes, r.left_context_codes + r.right_context_codes,
            r.plan_margin)

    def take(self, chunk: CodecChunk) -> None:
        if self._arrivals is None:
            self._arrivals = (self._now(), len(chunk.codes))
            self._producer_rate = chunk.codes_per_s
        self.codes.extend(chunk.codes)
        self._measure_opening(chunk.end)

    def _measure_opening(self, ended: bool) -> None:
        """Once ``OPENING_CODES`` codes came after the first chunk went (or the stream ended), add the rate they came
        at to the replica's openings (once)."""
        if self.openings is None or self._opening is None:
            return
        since, here = self._opening
        came, elapsed = len(self.codes) - here, self._now() - since
        if came >= OpeningRates.OPENING_CODES or (ended and came >= self.req.chunk_codes // 4):
            self._opening = None  # measured: complete() sets it only while the first chunk goes
            if elapsed > 0:
                self.openings.add(came / elapsed)

    def _now(self) -> float:
        return self.pace.clock() if self.pace is not None else time.monotonic()  # the deadlines' clock

    def _codes_in(self, codes: int) -> float:
        """Seconds until a later chunk of ``codes`` codes has its codes and right context, at the rate the stream's
        codes came since its first ones; 0 when they are here, when the upstream ended (the chunk is cut to what
        came) or while the rate is not known. Never decreasing in ``codes``. The runner sets ``pace`` before the
        first codes are fed, so arrivals and deadlines share one clock."""
        missing = self.start + codes + self.req.right_context_codes - len(self.codes)
        if missing <= 0 or self.upstream_done or self._arrivals is None:
            return 0.0
        since, first = self._arrivals
        elapsed, came = self._now() - since, len(self.codes) - first
        return missing * elapsed / came if came > 0 and elapsed > 0 else 0.0

    def drop_inputs(self) -> None:
        self.noise = self.mel_tail = None

    def _chunk_size(self) -> int:
        r, planned = self.req, self.planner is not None and self.pace is not None
        if not self.start:
            if planned and self._first_codes is None and self.codes:  # once: ready() asks on every engine tick
                known = [x for x in (self._producer_rate, self.openings and self.openings.median()) if x]
                rate = min(known) if known and not self.upstream_done else None  # (all here: nothing to wait for)
                arrivals = CodeArrivals(len(self.codes), rate, r.right_context_codes) if rate else None
                self._first_codes = self.planner.first(self.pace.playback.buffer_s, r.first_chunk_codes,
                                                       arrivals=arrivals)
            return self._first_codes or r.first_chunk_codes
        size = r.chunk_codes
        if r.chunk_growth:
            unit = self.model.block_codes
            size = max(unit, min(r.chunk_codes, int(r.chunk_growth * self.start) // unit * unit))
        if planned:
            lead = self.pace.slack()
            fit = self.planner.fit(lead, ready_in=self._codes_in)
            # The largest chunk that lands in time (calls planned plan_margin longer than estimated, after the wait
            # for its codes still to come), while chunks that land in time can keep the client playing even with
            # calls as estimated. Below that lead it runs dry whatever is sent: a whole chunk then stalls it once
            # and restores the lead, whereas shorter chunks would stall it again and again. (No chunk fits while
            # too few codes are here and more would come too late: the whole chunk then waits for its codes.)
            if fit and fit < size and self.planner.keeps_playing(lead, margin=0.0):
                size = fit
        return size

    def _chunk_end(self) -> int:
        r = self.req
        end = self.start + self._chunk_size()
        if self._limit_codes is not None:
            end = min(end, self.start + self._limit_codes)
        if self.upstream_done:
            return min(end, len(self.codes))
        if self.start and self.pace is not None and len(self.codes) < end + r.right_context_codes:
            # The client runs dry before the whole chunk's codes come: a shorter chunk of the codes here (whole
            # blocks) goes now, unless it is dry already (then the full chunk: cutting it would cost every stream
            # throughput and buy this one little).
            if 0 < self.pace.slack() <= r.cut_lead_s:
                unit = self.model.block_codes
                here = (len(self.codes) - r.right_context_codes - self.start) // unit * unit
                if here >= unit:
                    return self.start + here
        return end

    def ready(self) -> bool:
        if self.done:
            return False
        if self.upstream_done:
            return True
        return len(self.codes) >= self._chunk_end() + self.req.right_context_codes

    def _noise(self, frames: int) -> torch.Tensor:
        if frames > self.noise.shape[0]:
            more = torch.randn(1, frames - self.noise.shape[0], self.model.mel_dim, generator=self.generator)
            self.noise = torch.cat([self.noise, more[0]])
        return self.noise

    def _window(self) -> tuple[int, int, int]:
        """(first code of the next DiT window, its end, the end of the chunk it yields)."""
        r, end = self.req, self._chunk_end()
        return max(0, self.start - r.left_context_codes), min(len(self.codes), end + r.right_context_codes), end

    def work_size(self) -> float:
        lo, hi, _ = self._window()
        return float(max(hi - lo, 0) * self.model.repeats)  # mel frames the DiT solves

    def _frames_for(self, chunk_codes: int) -> float:
        """Mel frames of the next window with a chunk of at most ``chunk_codes``."""
        saved, self._limit_codes = self._limit_codes, chunk_codes
        try:
            return self.work_size()
        finally:
            self._limit_codes = saved

    def least_size(self) -> float | None:
        return self._frames_for(self.model.block_codes)  # a chunk of one DiT block

    def limit(self, size: float) -> None:
        """The next chunk as long as fits ``size`` mel frames (whole blocks, at least one)."""
        unit, r = self.model.block_codes, self.req
        context = min(self.start, r.left_context_codes) + r.right_context_codes
        codes = int(size / self.model.repeats - context) // unit * unit
        self._limit_codes = max(unit, codes)

    def work(self):
        if self.start >= len(self.codes):  # upstream ended: nothing (more) to synthesize
            self._limit_codes = None
            return (0,), None
        r, rep = self.req, self.model.repeats
        lo, hi, end = self._window()
        if not self.upstream_done and end + r.right_context_codes > len(self.codes):
            # The chunk grew after ready() looked (time passed and its lead crossed a planning threshold): the
            # whole blocks whose right context is here go (ready() saw at least one), or the seam would not match.
            unit = self.model.block_codes
            end = self.start + max(unit, (len(self.codes) - r.right_context_codes - self.start) // unit * unit)
            hi = end + r.right_context_codes
        noise = self._noise(rep * hi)[rep * lo:rep * hi]
        self._pending_end = end
        self._limit_codes = None
        job = _Job(DiTWindow(self.codes[lo:hi], noise, r.voice), (rep * (self.start - lo), rep * (end - lo)),
                   self.mel_tail, r.vocoder_context_frames, end - self.start)
        # Windows of any length share one DiT call (packed); a request's first window (its time to first audio)
        # is keyed apart, and smaller keys run first, so it never waits behind other requests' long windows.
        return (0 if self.start == 0 else 1,), job

    def complete(self, result) -> list[WaveChunk]:
        if result is None:
            self.done = True
            return [] if self.emitted else [WaveChunk.empty()]
        wav, chunk_mel = result
        self.mel_tail = torch.cat([self.mel_tail, chunk_mel], dim=1)[:, -self.req.vocoder_context_frames:]
        n = self._pending_end - self.start
        if not self.start and self._opening is None:
            self._opening = (self._now(), len(self.codes))
        self.start = self._pending_end
        self.emitted = True
        self.done = self.upstream_done and self.start >= len(self.codes)
        self._measure_opening(self.upstream_done)
        return [self.sent(WaveChunk(wav.numpy(), n))]


class Code2WavCompute:
    """The batch engine's ``compute``: one DiT solve for all the windows (any lengths, packed), then the vocoder."""

    def __init__(self, model: OmniCode2Wav, num_steps: int, guidance_scale: float, sway_coefficient: float):
        self.model = model
        self.settings = (num_steps, guidance_scale, sway_coefficient)

    def __call__(self, jobs: list[_Job | None]) -> list:
        real = [j for j in jobs if j is not None]
        mels = iter(self.model.dit_windows([j.window for j in real], *self.settings) if real else [])
        out = []
        for job in jobs:
            if job is None:
                out.append(None)
                continue
            mel = next(mels)
            lo, hi = job.keep
            chunk = mel[:, lo:hi]
            right = mel[:, hi:hi + job.context]
            left = job.mel_left
            wav = self.model.vocode(torch.cat([left, chunk, right], dim=1))
            spf = self.model.samples_per_frame
            out.append((wav[left.shape[1] * spf:(left.shape[1] + chunk.shape[1]) * spf].cpu(), chunk))
        return out
