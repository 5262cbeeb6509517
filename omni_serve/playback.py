"""What a listener hears: a stream's audio chunks played by a client that keeps a buffer.

Contract: ``Playback(buffer_s, start)`` follows one stream. ``add(t, seconds)`` takes each audio chunk as it
arrives (``t`` on any clock, the same as ``start``; chunks without audio are ignored), and ``figures()`` says what
the listener heard. The same object tells a server when the stream needs its next chunk: ``due()``.

``StreamDeadline(target_ttfp_s, buffer_s)`` is a server's side of the same client: ``sent(seconds)`` as each chunk
leaves, and ``due()``, when the stream needs its next chunk (``slack()``: how long until then): ``target_ttfp_s`` after the stream began until its
first audio is sent, then the moment the client's buffer would run dry.

The client model (documented in docs/speech_under_load.md): playback starts ``buffer_s`` seconds after the first
audio arrives (a jitter buffer; 0 plays at once) and runs at real time. A chunk that arrives after the moment its
first sample was due to play is a **stall** of that lateness: the listener hears silence until it arrives, then
playback resumes from there (the client does not re-buffer, so every later chunk is due that much later).

Figures (seconds unless named otherwise):
- ``ttfp``: first audio - ``start``; ``audio_s``: audio received.
- ``gaps``: time between consecutive chunks' arrivals.
- ``headroom``: per chunk after the first, the audio still buffered when it arrived (``due()`` - arrival before
  it is added; negative: a stall); ``min_headroom``: the least of them (None with fewer than two chunks).
- ``stalls`` and ``stall_s``: how many chunks came late, and the silence they caused in all.
- ``rtf_after_first``: time from the first chunk to the last / audio after the first chunk (< 1: the stream is
  produced faster than it plays); None when all the audio came in one chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class PlaybackFigures:
    ttfp: float | None
    audio_s: float
    chunks: int
    stalls: int
    stall_s: float
    min_headroom: float | None
    rtf_after_first: float | None
    gaps: list[float] = field(default_factory=list)
    headroom: list[float] = field(default_factory=list)


class Playback:
    def __init__(self, buffer_s: float = 0.5, start: float = 0.0):
        if buffer_s < 0:
            raise ValueError(f"buffer_s must be >= 0, not {buffer_s}")
        self.buffer_s, self.start = buffer_s, start
        self.first: float | None = None  # arrival of the first audio
        self.last: float | None = None  # arrival of the latest audio
        self.first_seconds = 0.0
        self.audio_s = 0.0
        self.stalls = 0
        self.stall_s = 0.0
        self.gaps: list[float] = []
        self.headroom: list[float] = []

    def due(self) -> float | None:
        """When playback runs dry unless more audio arrives (None before the first audio): the deadline of the
        stream's next chunk."""
        if self.first is None:
            return None
        return self.first + self.buffer_s + self.stall_s + self.audio_s

    def add(self, t: float, seconds: float) -> None:
        if seconds <= 0:
            return
        if self.first is None:
            self.first, self.first_seconds = t, seconds
        else:
            self.gaps.append(t - self.last)
            headroom = self.due() - t
            self.headroom.append(headroom)
            if headroom < 0:
                self.stalls += 1
                self.stall_s -= headroom
        self.last = t
        self.audio_s += seconds

    def figures(self) -> PlaybackFigures:
        rest = self.audio_s - self.first_seconds
        return PlaybackFigures(
            ttfp=None if self.first is None else self.first - self.start, audio_s=self.audio_s,
            chunks=len(self.gaps) + (self.first is not None), stalls=self.stalls, stall_s=self.stall_s,
            min_headroom=min(self.headroom) if self.headroom else None,
            rtf_after_first=(self.last - self.first) / rest if rest > 0 else None,
            gaps=list(self.gaps), headroom=list(self.headroom))


def replay(arrivals: list[tuple[float, float]], buffer_s: float, start: float = 0.0) -> PlaybackFigures:
    """The figures of recorded ``(arrival, seconds)`` chunks played with a ``buffer_s`` client buffer."""
    playback = Playback(buffer_s, start)
    for t, seconds in arrivals:
        playback.add(t, seconds)
    return playback.figures()


class StreamDeadline:
    def __init__(self, target_ttfp_s: float, buffer_s: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.playback = Playback(buffer_s, clock())
        self.first_due = self.playback.start + target_ttfp_s

    def sent(self, seconds: float) -> None:
        self.playback.add(self.clock(), seconds)

    def due(self) -> float:
        due = self.playback.due()
        return self.first_due if due is None else due

    def slack(self) -> float:
        """Seconds until ``due()`` (negative: the client has run dry)."""
        return self.due() - self.clock()
