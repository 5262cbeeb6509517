"""Admission by real-time capacity: a new audio stream starts only while every stream already admitted keeps up.

Contract: ``RealtimeAdmission(settings, buffer_s, target_ttfp_s)`` (``settings``: a graph's ``playback.admission``,
an ``AdmissionSpec``; the other two: its ``playback`` client buffer and first-audio target) is kept by the frontend
of a graph that speaks. ``await enter(request_id)`` admits a request that asked for audio, before any stage is
called, and returns its ``StreamTicket``; ``ticket.audio(seconds)`` as each chunk reaches the client,
``ticket.release()`` when the stream ends (idempotent; the ingress calls it however the request ends). ``state()``
is what ``/health`` shows; ``autoscaling_stats()`` what the ingress reports to Serve's autoscaler (the
``speech`` part of ``omni_serve.autoscaling.StageRatioPolicy`` scales the stages that bound speech on it).

Policies (``settings.policy``):
- ``none``: every request is admitted (the ingress' ``max_inflight_requests`` still bounds them).
- ``queue``: a request that cannot be admitted waits, in arrival order (or in the order its client first asked,
  ``enter(..., since=)``), up to ``max_wait_s``, then gets a 429 with
  ``Retry-After``; beyond ``max_queued`` waiting, a 429 at once. Unset, a request waits only while it can still hear
  its first audio within ``target_ttfp_s``: the target less what an admitted stream takes from admission to its
  first chunk (the median of the last 16; 0, so the whole target, before one was measured), at least
  ``min_wait_s``. The wait counts in the request's time to first audio, so where admitted streams get their first
  chunk within the target, the streams that waited hear theirs at about the target (later by as much as their own
  first chunk takes longer than the median); the others get their 429 while a retry elsewhere can still start.
  A realtime session's response waits up to ``session_max_wait_s`` instead (``enter(request_id, max_wait_s)``): the
  realtime protocol has no ``Retry-After``, and the session is bound to this replica.
- ``reject``: a request that cannot be admitted now gets a 429 with ``Retry-After`` at once.

The 429's ``Retry-After`` grows with the line: at least ``retry_after_s``, it is what brings the clients refused
and not yet due back (with this one) back about ``RETRIES_PER_PLACE`` times for each place that frees (places free
at the admitted streams over their median lifetime), at most ``max_retry_after_s``. A fixed second under a long
line has every waiting client ask again every second, and on a small machine the HTTP proxy and the ingress answering
them take their CPU from the streams playing (docs/benchmarks.md, speech under load).

When a stream can be admitted: when none is admitted; otherwise when the capacity is known, the admitted streams
with the new one would each still be produced at least ``1 + margin`` times as fast as they play, and every
admitted stream has heard its first audio and has more than ``guard_s`` of audio ahead of its client (its buffer,
as ``omni_serve.playback`` models it with ``buffer_s``; a stream still without audio after twice the median time to
a first chunk, at least ``target_ttfp_s``, is stuck rather than starting, and no longer holds admission back).
Whether the streams would keep ``1 + margin``: by default (``one_more: delivered``) the capacity shared by one more
stream (``capacity / (admitted + 1) >= 1 + margin``); with ``one_more: auto``, where every stage reports its CPU use
(``cpu_source``, set by the ingress, read every ``CPU_REFRESH_S`` while streams are admitted), by projecting it to
the admitted streams at that speed and a new one opening at ``opening_speed`` (``omni_serve.realtime_projection``:
the fixed part of each step scales with the speed, the rest with the audio made in all; it must fit each replica's
threads and the cluster's CPUs).
A new stream's start (its prefill, its first chunks made as fast as the stages go) slows the others for a few
seconds: streams that just started have no lead to spend on it, so streams start one at a time, each once the
others have a lead. Two streams started together, when two ended together, ramp with no lead to spare and stall in
their first chunks.

The capacity is the audio seconds per second the graph produced over the last ``window_s`` of a busy period (from
the first admission of the period on), measured here, at the ingress, from the chunks it passes to clients. Each
chunk counts over the time it was produced: from its stream's previous chunk (its first chunk: from the stream's
admission, so the time to first audio is part of the cost) to its arrival. Counting a chunk at its arrival instead
makes the rate jump by a chunk's length (up to about 1.4 s of audio) as a chunk enters or leaves the window, and
overstates it while a stream ramps up (its first chunks come faster than it plays); spread over its production, a
chunk moves the rate by the part of it inside the window. Chunks still being produced are not counted yet: the
estimate leans low by about half a chunk per stream, the safe side. The first estimate waits for 1 s of the period
(or half the window if shorter), or for the period's end, whichever comes first: a busy period of short streams on
a fast graph is measured too. A window that holds only streams' first chunks is no measure: it is made of openings
(prefill and a short first chunk), as when answers are cut at their first audio by a barge-in, and the last
estimate stands.

Why the delivered rate, measured here: it counts every stage, every replica and the cores they share. While streams
are produced as fast as the stages go (every admitted stream is backlogged), it is the capacity at the current load,
and with the stages' CPU use it says how fast each stream goes now, which the projection scales from. Alone it
gets one more stream wrong both ways: batching makes it cheaper than the average stream (the estimate is low), and
once the stages' shared cores are all busy, dearer (the estimate is high). It is kept from one busy period to the
next; before any was measured, only one stream is admitted at a time.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import heapq
import logging
import math
import statistics
import time
from typing import Awaitable, Callable, Literal

from pydantic import BaseModel, Field, model_validator

from omni_serve.api.errors import too_many_requests
from omni_serve.playback import Playback
from omni_serve.realtime_projection import Projection, StageCpu, project

log = logging.getLogger(__name__)

RETRIES_PER_PLACE = 8  # refused clients' retries per place freed: a freed place waits about an eighth of an interval
CPU_REFRESH_S = 1.0  # how often the stages' CPU use is read while streams are admitted
# what the stages' CPU use is read from: (each stage's use, or None where one does not report it; the cluster's CPUs)
CpuSource = Callable[[], Awaitable[tuple[list[StageCpu] | None, float]]]


class AdmissionSpec(BaseModel):
    """Admission of audio streams by the graph's real-time capacity (docs/speech_under_load.md)."""

    policy: Literal["none", "queue", "reject"] = Field("none", description=(
        "none: every request is admitted; queue: a request the capacity cannot take waits up to max_wait_s, "
        "then gets a 429; reject: it gets a 429 at once. Requests without audio are never held."))
    margin: float = Field(0.2, ge=0, description=(
        "Admit while every stream, with the new one, is still produced at least 1 + margin times as fast as it "
        "plays. More margin: fewer streams, more room for bursts."))
    max_wait_s: float | None = Field(None, ge=0, description=(
        "queue: the longest a request waits for admission before its 429. The wait counts in its time to first "
        "audio; unset, it is what playback.target_ttfp_s leaves after the measured time from admission to first "
        "audio (the median of the last 16 streams), at least min_wait_s, so that a stream that waited hears its "
        "first audio at about the target where admitted streams start within it. Longer: fewer 429s, later "
        "first audio."))
    min_wait_s: float = Field(0.1, ge=0, description=(
        "queue with max_wait_s unset: the shortest wait, so that a place given back just after a request arrived "
        "still goes to it when admitted streams take about the whole target to their first audio."))
    session_max_wait_s: float = Field(10.0, ge=0, description=(
        "queue: the longest a response of a /v1/realtime session waits for admission before it fails with "
        "rate_limit_exceeded. The realtime protocol has no Retry-After and voice clients do not ask again by "
        "themselves, and a session cannot go to another replica: its answer waits its turn instead. Longer: fewer "
        "failed answers, later first audio under overload."))
    max_queued: int = Field(64, ge=0, description="queue: requests waiting at most; beyond, a 429 at once.")
    opening_speed: float = Field(2.0, ge=1, description=(
        "one_more auto: the speed (audio seconds per second) a new stream is projected at while it opens, the "
        "others at 1 + margin: its first chunks must come well ahead of real time for a client that starts "
        "playing half a second after its first audio. Higher: fewer streams at once, fewer stalls as one opens."))
    one_more: Literal["delivered", "auto"] = Field("delivered", description=(
        "How admission judges whether one more stream keeps 1 + margin. delivered: the measured capacity shared by "
        "one more stream. auto: the stages' CPU use projected to one more stream (opening at opening_speed) where "
        "every stage runs on the CPU and reports it, else as delivered; it admits more streams at once where "
        "batching pays, and on two cores it stalled more streams in their openings (docs/benchmarks.md)."))
    window_s: float = Field(4.0, gt=0, description=(
        "The capacity is the audio produced per second over the last window_s seconds of the busy period (each "
        "chunk spread over the time since its stream's previous chunk). Longer: steadier, slower to follow."))
    guard_s: float = Field(1.0, ge=0, description=(
        "Nothing new is admitted until every admitted stream has heard its first audio and has more than this "
        "many seconds of audio ahead of its client: a new stream's start slows the others, so each starts once "
        "the others have a lead to spend. Lower: new streams start sooner, the ones playing risk a stall."))
    retry_after_s: float = Field(1.0, gt=0, description=(
        "The shortest Retry-After of the 429; it grows with the clients refused and not yet due back, so that they "
        "come back a few times for each place that frees, up to max_retry_after_s."))
    max_retry_after_s: float = Field(30.0, gt=0, description=(
        "The longest Retry-After of the 429 (OpenAI's client waits up to 60 s between its retries)."))

    @model_validator(mode="after")
    def _retry_bounds(self):
        if self.max_retry_after_s < self.retry_after_s:
            raise ValueError(f"max_retry_after_s ({self.max_retry_after_s}) is below retry_after_s "
                             f"({self.retry_after_s})")
        return self


class StreamTicket:
    def __init__(self, admission: "RealtimeAdmission", request_id: str):
        self.admission: RealtimeAdmission | None = admission
        self.request_id = request_id
        self.playback = Playback(admission.buffer_s, admission.clock())
        self.produced_until = self.playback.start  # the previous chunk's arrival: where the next one's production began

    def audio(self, seconds: float) -> None:
        if self.admission is not None and seconds > 0:
            self.admission._delivered(self, seconds)

    def release(self) -> None:
        if self.admission is not None:
            admission, self.admission = self.admission, None
            admission._left(self)


class RealtimeAdmission:
    def __init__(self, settings: AdmissionSpec, buffer_s: float, target_ttfp_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        self.settings, self.buffer_s, self.target_ttfp_s, self.clock = settings, buffer_s, target_ttfp_s, clock
        self.admitted: set[StreamTicket] = set()
        self.capacity: float | None = None  # audio seconds per second, last measured
        self.rejected = 0
        self._time_to_first_chunk: collections.deque[float] = collections.deque(maxlen=16)  # admission to first chunk
        # Requests waiting, in the order their clients first asked: (since, arrival number, request id, its future).
        self._waiters: list[tuple[float, int, str, asyncio.Future]] = []
        self._order = 0
        # Each chunk as (production began, arrival, seconds, a stream's later chunk), oldest arrival first.
        self._chunks: collections.deque[tuple[float, float, float, bool]] = collections.deque()
        self._period_start = 0.0  # first admission of the busy period
        self._due_back: list[float] = []  # heap: when each refused client, not yet back, is due back
        self._lifetimes: collections.deque[float] = collections.deque(maxlen=16)  # admission to release
        # The stages' CPU use and the cluster's CPUs, read every CPU_REFRESH_S while streams are admitted (the
        # ingress sets ``cpu_source``); None: not known, the delivered rate alone decides.
        self.cpu_source: CpuSource | None = None
        self.stage_cpu: list[StageCpu] | None = None
        self.cores = 0.0
        self._cpu_task: asyncio.Task | None = None

    # -- requests ---------------------------------------------------------------------------------------------
    async def enter(self, request_id: str, max_wait_s: float | None = None,
                    since: float | None = None) -> StreamTicket:
        """Admit ``request_id`` (see the module doc); ``max_wait_s``, under ``queue``, instead of ``self.max_wait_s``
        (a realtime session's response: ``session_max_wait_s``). ``since`` (this admission's ``clock``) is when the
        client first asked for what this request asks again for: the line is in that order, so a client refused
        before keeps its place (a realtime session's answer; default: now)."""
        s = self.settings
        wait_s = self.max_wait_s if max_wait_s is None else max_wait_s
        since = self.clock() if since is None else since
        first_in_line = not self._waiters or since < self._waiters[0][0]
        if s.policy == "none" or (first_in_line and self.can_admit()):
            return self._admit(request_id)
        if s.policy == "reject" or len(self._waiters) >= s.max_queued:
            raise self._refusal("it cannot start now")
        self._order += 1
        entry = (since, self._order, request_id, asyncio.get_running_loop().create_future())
        bisect.insort(self._waiters, entry, key=lambda e: e[:2])
        ticket = None
        try:
            ticket = await asyncio.wait_for(asyncio.shield(entry[3]), wait_s)
            return ticket
        except asyncio.TimeoutError:
            if entry in self._waiters:
                self._waiters.remove(entry)  # out of the line before its Retry-After counts the line
            raise self._refusal(f"it waited {wait_s:g} s") from None
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)
            waiter = entry[3]
            if ticket is None and waiter.done() and not waiter.cancelled():
                waiter.result().release()  # admitted just as it timed out or its client left
            elif not waiter.done():
                waiter.cancel()

    @property
    def max_wait_s(self) -> float:
        """How long a request may wait for admission (``queue``)."""
        given = self.settings.max_wait_s
        if given is not None:
            return given
        first_chunk = statistics.median(self._time_to_first_chunk) if self._time_to_first_chunk else 0.0
        return max(self.settings.min_wait_s, self.target_ttfp_s - first_chunk)

    def can_admit(self) -> bool:
        if not self.admitted:
            return True
        if self.capacity is None:
            return False
        projection = self.projection()
        if projection is not None:
            if not projection.fits:
                return False
        elif self.capacity / (len(self.admitted) + 1) < 1 + self.settings.margin:
            return False
        now = self.clock()
        horizon, starting = now + self.settings.guard_s, self._starting_s()
        return all(due > horizon if (due := t.playback.due()) is not None else now - t.playback.start > starting
                   for t in self.admitted)

    def projection(self, streams: int | None = None) -> Projection | None:
        """The stages' CPU use projected from the admitted streams, at the speed the capacity gives each, to one
        more (the default; it opens at ``opening_speed``, the others at ``1 + margin`` times real time) or to
        ``streams`` streams, each at ``1 + margin`` (``omni_serve.realtime_projection``); None when not every
        stage reports its use, or nothing is measured."""
        if self.stage_cpu is None or self.capacity is None or not self.admitted:
            return None
        n, s = len(self.admitted), self.settings
        if streams is None:
            return project(self.stage_cpu, n, self.capacity / n, self.cores, n + 1, 1 + s.margin, s.opening_speed)
        return project(self.stage_cpu, n, self.capacity / n, self.cores, streams, 1 + s.margin)

    def _starting_s(self) -> float:
        """How long a stream without audio holds admission back: twice the median time to a first chunk, at least
        ``target_ttfp_s``. Past it the stream is stuck (a failed talker, a hung stage) rather than starting, and the
        streams that could play are not held back by it."""
        first = statistics.median(self._time_to_first_chunk) if self._time_to_first_chunk else 0.0
        return max(self.target_ttfp_s, 2 * first)

    def autoscaling_stats(self) -> dict[str, float]:
        """The speech load for Serve's autoscaler: ``speech_admitted``; ``speech_waiting``, the requests queued plus
        the clients refused and not yet due back (each comes back after its Retry-After); and ``speech_deficit``,
        the capacity the graph lacks to play all of them at ``1 + margin`` times real time, as a fraction of the
        capacity it has (0: it lacks none; 1: it needs twice as much): with the stages' CPU use, their projection
        to all of those streams over what fits at its tightest bound (an engine thread, or the cluster's CPUs), and
        at least what keeps the next one out; otherwise from the delivered rate. 0 before a capacity was measured:
        what limits the graph then is the rule of one stream at a time until it is measured, not its capacity."""
        admitted, waiting = len(self.admitted), len(self._waiters) + self._refused_out()
        deficit = 0.0
        if waiting and self.capacity:
            every, next_one = self.projection(admitted + waiting), self.projection()
            if every is not None and next_one is not None:
                # at least what keeps the next one out (it opens faster than the others play), so that the streams
                # refused by admission are never a deficit of 0 to the autoscaler
                deficit = max(0.0, every.load - 1, next_one.load - 1)
            else:
                deficit = max(0.0, (admitted + waiting) * (1 + self.settings.margin) / self.capacity - 1)
        return {"speech_admitted": float(admitted), "speech_waiting": float(waiting), "speech_deficit": deficit}

    def state(self) -> dict:
        projection = self.projection()
        return {"policy": self.settings.policy, "admitted": len(self.admitted), "queued": len(self._waiters),
                "max_wait_s": round(self.max_wait_s, 3) if self.settings.policy == "queue" else 0.0,
                "capacity_audio_s_per_s": None if self.capacity is None else round(self.capacity, 3),
                "one_more": None if projection is None else projection.describe() + (
                    ": fits" if projection.fits else f": {projection.bound} does not fit"),
                "rejected": self.rejected}

    # -- internals --------------------------------------------------------------------------------------------
    def retry_after(self) -> int:
        """The Retry-After, whole seconds, of a 429 sent now (the module docstring's rule)."""
        s, now = self.settings, self.clock()
        # the refused clients not yet back, and this one; not the requests queued here: they arrived after this one
        # (it leaves the queue first) and are refused after it, or admitted
        line = self._refused_out() + 1
        wait = s.retry_after_s
        if self.admitted:
            # before a stream ended, the oldest playing one's age is a lower bound on a lifetime
            lifetime = (statistics.median(self._lifetimes) if self._lifetimes
                        else max(now - t.playback.start for t in self.admitted))
            frees_every = lifetime / len(self.admitted)
            wait = min(s.max_retry_after_s, max(wait, line * frees_every / RETRIES_PER_PLACE))
        return max(1, math.ceil(wait))

    def _refused_out(self) -> int:
        """Refused clients not yet due back."""
        now = self.clock()
        while self._due_back and self._due_back[0] <= now:
            heapq.heappop(self._due_back)
        return len(self._due_back)

    def _refusal(self, why: str):
        self.rejected += 1
        retry_after = self.retry_after()
        heapq.heappush(self._due_back, self.clock() + retry_after)
        cap = "unknown" if self.capacity is None else f"{self.capacity:.2f} audio s/s"
        return too_many_requests(
            f"The server is at its real-time capacity for speech ({len(self.admitted)} streams playing, capacity "
            f"{cap}); {why}. Retry after {retry_after} s.", retry_after)

    def _admit(self, request_id: str) -> StreamTicket:
        if not self.admitted:  # a new busy period
            self._period_start = self.clock()
            self._chunks.clear()
        ticket = StreamTicket(self, request_id)
        self.admitted.add(ticket)
        if self.cpu_source is not None and (self._cpu_task is None or self._cpu_task.done()):
            try:
                self._cpu_task = asyncio.get_running_loop().create_task(self._read_cpu())
            except RuntimeError:  # admitted from outside the event loop: read from the next admission on
                pass
        return ticket

    async def _read_cpu(self) -> None:
        """Read the stages' CPU use every ``CPU_REFRESH_S`` while streams are admitted (a failed read: not known
        until the next one succeeds); cancelled when the busy period ends."""
        failing = False
        while self.admitted:
            try:
                self.stage_cpu, self.cores = await self.cpu_source()
                failing = False
            except Exception as exc:  # noqa: BLE001 - admission falls back on the delivered rate
                if not failing:  # once per run of failures, not every second
                    log.warning("reading the stages' CPU use failed (%r): admission by the delivered rate", exc)
                self.stage_cpu, failing = None, True
            try:
                self._wake()
            except Exception:  # noqa: BLE001 - the reader outlives a failed admission
                log.exception("admitting after reading the stages' CPU use failed")
            await asyncio.sleep(CPU_REFRESH_S)

    def _delivered(self, ticket: StreamTicket, seconds: float) -> None:
        now = self.clock()
        later = ticket.playback.first is not None
        if not later:
            self._time_to_first_chunk.append(now - ticket.playback.start)
        ticket.playback.add(now, seconds)
        self._chunks.append((ticket.produced_until, now, seconds, later))
        ticket.produced_until = now
        self._measure(now, least_s=min(1.0, self.settings.window_s / 2))
        self._wake()

    def _measure(self, now: float, least_s: float) -> None:
        """The capacity over the window ending now, once it spans at least ``least_s`` of the busy period and holds
        a stream's later chunk: a window of first chunks only (streams cut at their first audio, as a barge-in
        cuts a realtime answer) measures openings, prefill and a short chunk, not the rate streams are produced
        at, and would keep the next busy period to one stream at a time."""
        start = max(now - self.settings.window_s, self._period_start)
        while self._chunks and self._chunks[0][1] <= start:
            self._chunks.popleft()
        span = now - start
        if span >= least_s and span > 0 and any(later for *_, later in self._chunks):
            self.capacity = sum(_share_after(start, began, arrived, s) for began, arrived, s, _ in self._chunks) / span

    def _left(self, ticket: StreamTicket) -> None:
        self.admitted.discard(ticket)
        now = self.clock()
        if ticket.playback.first is not None:  # a stream that played: not one refused or failed at its start
            self._lifetimes.append(now - ticket.playback.start)
        if not self.admitted:  # the busy period ends: whatever it lasted, what it made is a measure
            self._measure(now, least_s=0.0)
            if self._cpu_task is not None:  # and nothing is read of the stages until the next one
                self._cpu_task.cancel()
                self._cpu_task = None  # the next period (maybe admitted just below) starts its own reader
            self.stage_cpu = None  # nor is this period's reading the next one's
        self._wake()

    def _wake(self) -> None:
        """Admit waiting requests, in order, while the capacity allows."""
        while self._waiters and self.can_admit():
            _, _, request_id, waiter = self._waiters.pop(0)
            if not waiter.done():
                waiter.set_result(self._admit(request_id))


def _share_after(start: float, began: float, arrived: float, seconds: float) -> float:
    """The audio of a chunk produced from ``began`` to ``arrived`` that falls after ``start``, at an even rate."""
    if began >= start or arrived <= began:
        return seconds
    return seconds * max(0.0, arrived - start) / (arrived - began)
