"""Chunk sizes that keep a client playing: how much audio a streamed chunk may carry so that it arrives before its
client runs dry, and how much the first must carry so that the lead never runs out.

Contract: ``ChunkPlanner(call_s, audio_per_code, unit, cap, context_first, context_later, margin)``, where
``call_s(codes)`` is what a call computing a window of ``codes`` codes costs in seconds (the batch engine's
``CostModel`` in the program's units), or None while nothing was timed; chunks are whole ``unit``s of codes, at
most ``cap``; a window is its chunk plus ``context_first`` codes (a stream's first chunk) or ``context_later``
codes (every later one) of context; the plan assumes calls cost ``1 + margin`` times the estimate.

- ``fit(lead_s, margin=None, *, ready_in=None)``: the most codes a later chunk may have so that a call started with
  ``lead_s`` seconds of audio still buffered at its client ends before the client runs dry; 0 when not even one
  unit fits. None while nothing was timed. ``ready_in(codes)``, when given, is how long until a chunk of ``codes``
  codes can start (its codes and whatever context the caller's windows need have come; 0 when they are here),
  never decreasing in ``codes``: that wait counts against the lead, so a chunk of the codes here, which can start
  now, is preferred to a longer one that would start too late.
- ``keeps_playing(lead_s, margin, *, arrivals=None)``: whether chunks of ``fit`` sizes from a lead of ``lead_s``
  never let the client run dry. A stream for which even ``margin=0`` (calls as estimated) says no will run dry
  whatever is sent: a full chunk then stalls it once, whereas shorter ones would stall it again and again.
  ``arrivals`` (``CodeArrivals``: the codes here and the rate more come at) makes each chunk wait for its codes.
- ``first(buffer_s, least, *, arrivals=None)``: the smallest first chunk (whole units, at least ``least``, at most
  ``cap``) after which chunks of ``fit`` sizes, each started as the one before lands (and its codes have come, with
  ``arrivals``), never let the client run dry: its lead when the first chunk lands is ``buffer_s`` plus that chunk's
  audio. ``least`` while nothing was timed, and when no size keeps the client playing (the stage, or the codes'
  producer, is slower than real time at its load: the stream will run dry whatever its first chunk, so its first
  audio stays early; admission is what keeps such streams out).

Why: a window costs a fixed amount plus its context, so on a machine that produces a stream barely faster than
real time a short chunk costs more time than the audio it carries. A client that starts with a short first chunk
and a small buffer then always runs dry once, and cutting later chunks shorter only makes it run dry more often.
Below a certain lead no chunk size keeps up; above it, the largest chunk that fits grows the lead. The first chunk
is therefore as long as it must be to start above that lead on this machine and no longer: a fast machine (a GPU,
AMX) keeps the short first chunk and its early first audio, a slow one trades some first-audio time for no gap.
``OpeningRates`` keeps the rates recent streams' codes came at in their openings (the rate a plan expects is the
lower of the talker's own and their median).

Without ``arrivals``, ``first`` and ``keeps_playing`` assume the codes come as fast as the chunks need them (a talker
far ahead of real time). With them, a producer barely faster than real time (the talker of a chat reply, sharing
the CPU with the thinker that feeds it) asks for a longer first chunk: each later chunk then waits for its codes, so
the lead grows only by what the producer gains on real time, and a short first chunk would leave the client dry a
few chunks in. A later chunk's ``fit`` counts how long its codes are still to come (``ready_in``), and a chunk whose
codes come later than planned is cut to the codes here (the code2wav program's ``cut_lead_s``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MAX_PLANNED_CHUNKS = 32  # chunks simulated before a first chunk is judged unable to keep its client playing


class OpeningRates:
    """The rates (codes per second) at which recent streams' codes came in their openings, from when their first
    chunk went until ``OPENING_CODES`` more came (or the stream ended): the median of the last ``keep``. A talker
    measures its own rate before code2wav starts on its stream, and slows once code2wav shares the cores with it; a
    replica's recent openings say how much."""

    OPENING_CODES = 96

    def __init__(self, keep: int = 16):
        self.keep, self.rates = keep, []

    def add(self, rate: float) -> None:
        self.rates = (self.rates + [rate])[-self.keep:]

    def median(self) -> float | None:
        ordered = sorted(self.rates)
        return ordered[(len(ordered) - 1) // 2] if ordered else None  # the lower middle of an even count


@dataclass(frozen=True)
class CodeArrivals:
    """Codes as a plan expects them: ``here`` codes have come (counted from the stream's first), and more come at
    ``rate`` codes per second; a chunk's call also waits for ``lookahead`` codes past its end (its right context)."""

    here: int
    rate: float
    lookahead: int = 0

    def wait(self, end: int, at: float) -> float:
        """Seconds after ``at`` (seconds from when ``here`` was counted) until codes up to ``end`` (and the
        lookahead) have come; 0 when they have."""
        return max(0.0, (end + self.lookahead - self.here) / self.rate - at)


class ChunkPlanner:
    def __init__(self, call_s: Callable[[int], float | None], audio_per_code: float, unit: int, cap: int,
                 context_first: int, context_later: int, margin: float = 0.3):
        if unit <= 0 or cap < unit or audio_per_code <= 0 or margin < 0:
            raise ValueError(f"bad chunk plan: unit={unit} cap={cap} audio_per_code={audio_per_code} "
                             f"margin={margin}")
        self.call_s, self.audio_per_code, self.unit, self.cap = call_s, audio_per_code, unit, cap
        self.context_first, self.context_later, self.margin = context_first, context_later, margin

    def _cost(self, codes: int, margin: float) -> float | None:
        seconds = self.call_s(codes)
        return None if seconds is None else seconds * (1 + margin)

    def fit(self, lead_s: float, margin: float | None = None, *,
            ready_in: Callable[[int], float] | None = None) -> int | None:
        margin = self.margin if margin is None else margin
        if self._cost(self.unit + self.context_later, margin) is None:
            return None
        best = 0
        for codes in range(self.unit, self.cap + 1, self.unit):  # at most cap / unit (8 by default) estimates
            wait = ready_in(codes) if ready_in is not None else 0.0
            if wait + self._cost(codes + self.context_later, margin) > lead_s:
                break  # both grow with the chunk: no longer one lands in time either
            best = codes
        return best

    def keeps_playing(self, lead_s: float, margin: float | None = None, *, arrivals: CodeArrivals | None = None,
                      sent: int = 0, at: float = 0.0) -> bool:
        """Whether a client with ``lead_s`` of audio buffered as the next call starts never runs dry, with calls
        ``margin`` (default: the planner's) longer than estimated. With ``arrivals``, a chunk also waits for its
        codes: ``sent`` codes were chunked before this call, which starts ``at`` seconds into ``arrivals``' clock."""
        margin = self.margin if margin is None else margin
        for _ in range(MAX_PLANNED_CHUNKS):
            def ready_in(codes: int, sent=sent, at=at) -> float:
                return arrivals.wait(sent + codes, at) if arrivals is not None else 0.0
            codes = self.fit(lead_s, margin, ready_in=ready_in)
            if not codes:
                return False
            spent = ready_in(codes) + self._cost(codes + self.context_later, margin)
            after = lead_s - spent + codes * self.audio_per_code
            if codes == self.cap and after >= lead_s and (arrivals is None or
                                                          arrivals.rate * self.audio_per_code >= 1):
                return True  # full chunks from here on, each adding lead (codes come at least as fast as they play)
            lead_s, sent, at = after, sent + codes, at + spent
        return False

    def first(self, buffer_s: float, least: int, *, arrivals: CodeArrivals | None = None) -> int:
        if self._cost(least + self.context_first, 0.0) is None:
            return least
        least = max(self.unit, least // self.unit * self.unit)
        for codes in range(least, self.cap + 1, self.unit):
            # the first call starts when its codes have come; the client's lead starts when it lands
            at = arrivals.wait(codes, 0.0) if arrivals is not None else 0.0
            at += self._cost(codes + self.context_first, 0.0)
            if self.keeps_playing(buffer_s + codes * self.audio_per_code, arrivals=arrivals, sent=codes, at=at):
                return codes
        return least
