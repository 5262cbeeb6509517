"""The lifecycle of the Omni programs fed by a streamed edge (the talker from the thinker, code2wav from the
talker), and what code2wav hands its runner.

Contract: a program mixes in ``StreamedInput`` and supplies ``take(chunk)`` (add one upstream chunk's content to
its state) and ``drop_inputs()`` (drop every upstream tensor). The engine's pump then drives it the same way for
every family: ``feed`` takes a chunk and marks the stream ended on its last chunk (``end``), ``close_input`` ends
it when the upstream call ends without one, ``fresh`` tells the program inputs arrived since it last looked, and
``release`` drops the inputs when the request ends, so zero-copy connectors get their memory back. An
autoregressive talker is a ``StreamedSequence``: ready when inputs arrived or rows are pending; given a
``TalkerLead`` (a stream its client plays as it comes), it paces itself to stay that far ahead of the playback.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from omni_serve.engines.ar.sequence import ARSequence, Pace
from omni_serve.graph.messages import StreamChunk
from omni_serve.models.qwen2_5_omni_layout import SAMPLE_RATE
from omni_serve.playback import StreamDeadline


class StreamedInput:
    upstream_done: bool = False  # the upstream stream ended (its last chunk arrived, or its call ended)
    fresh: bool = False  # inputs arrived since the program last looked

    def take(self, chunk: StreamChunk) -> None:
        """Add one upstream chunk's content to the program's state."""
        raise NotImplementedError

    def drop_inputs(self) -> None:
        """Drop every upstream tensor the program holds."""
        raise NotImplementedError

    def feed(self, item: StreamChunk) -> None:
        self.take(item)
        if item.end:
            self.upstream_done = True
        self.fresh = True

    def close_input(self) -> None:
        self.upstream_done = True
        self.fresh = True

    def release(self) -> None:
        self.drop_inputs()


class PacedAudio:
    """An audio program whose chunks are due when its client needs them: ``pace`` (set by the runner from the
    graph's ``playback`` settings) gives the batch engine its ``deadline()``; ``sent(chunk)`` as each chunk is
    emitted."""

    pace: StreamDeadline | None = None
    sample_rate: int = SAMPLE_RATE

    def deadline(self) -> float | None:
        return None if self.pace is None else self.pace.due()

    def sent(self, chunk: "WaveChunk") -> "WaveChunk":
        if self.pace is not None:
            self.pace.sent(len(chunk.audio) / self.sample_rate)
        return chunk


def client_pace(spec) -> StreamDeadline:
    """A new stream's deadlines by the graph spec's ``playback`` settings (its first-audio target and client
    buffer), from now."""
    return StreamDeadline(spec.playback.target_ttfp_s, spec.playback.client_buffer_s)


class TalkerLead:
    """How far a talker keeps a played stream's codes ahead of its client's playback
    (``playback.talker_lead_s``).

    The talker cannot see the client, and code2wav reports nothing back to it (the data plane is one-way: a
    reading stage could only answer through another keyed payload per chunk). What it can count is a bound:
    the client cannot have played more than the time since the talker sent its first codes, so the codes sent
    less that time is at most their lead over the playback. Below ``lead_s`` the stream is due; up to twice
    that it rides along in steps other streams make run (its row costs little there); beyond, it holds. A
    talker faster than real time then spends its spare CPU on the streams that need it (a new stream's
    opening, code2wav) and batches its rows with theirs, instead of running ahead alone.
    """

    def __init__(self, lead_s: float, codes_per_s: float):
        self.lead_s, self.codes_per_s = lead_s, codes_per_s
        self.codes = 0
        self.since: float | None = None  # when the first codes were sent (time.monotonic)

    def sent(self, codes: int, now: float) -> None:
        if codes and self.since is None:
            self.since = now
        self.codes += codes

    def ahead_s(self, now: float) -> float:
        """The least the codes sent are ahead of the client's playback at ``now`` (it cannot have played more than
        the time since the first codes were sent)."""
        if self.since is None:
            return 0.0
        return self.codes / self.codes_per_s - (now - self.since)

    def pace(self, now: float) -> Pace:
        ahead = self.ahead_s(now)
        return Pace.DUE if ahead < self.lead_s else Pace.RIDE if ahead < 2 * self.lead_s else Pace.HOLD


def talker_lead(spec, paced: bool, codes_per_s: float) -> TalkerLead | None:
    """The pace of a talker stream by the graph spec's ``playback.talker_lead_s``: None (as fast as it can) for a
    reply its client does not play as it comes (``paced`` False) or with the setting off."""
    lead_s = spec.playback.talker_lead_s
    return TalkerLead(lead_s, codes_per_s) if paced and lead_s else None


class StreamedSequence(StreamedInput, ARSequence):
    """An autoregressive program fed by a stream: it has work when inputs arrived (``poll`` turns them into rows)
    or rows are pending. With ``lead`` set it paces itself by the codes it sent (``codes_sent``)."""

    lead: TalkerLead | None = None

    def ready(self) -> bool:
        return not self.done and (self.fresh or self.num_pending() > 0)

    def pace(self, now: float) -> Pace:
        return Pace.DUE if self.lead is None else self.lead.pace(now)

    def codes_sent(self, codes: int) -> None:
        """Count ``codes`` codec tokens (Qwen3-Omni: frames) sent downstream now."""
        if self.lead is not None:
            self.lead.sent(codes, time.monotonic())


@dataclass
class WaveChunk:
    """One synthesized chunk, handed to the code2wav runner in-process (it encodes it for the client)."""

    audio: np.ndarray  # float32 samples
    num_codes: int  # codec frames (Qwen2.5-Omni: tokens) the chunk's audio covers

    @classmethod
    def empty(cls) -> "WaveChunk":
        """The chunk a response without audio ends with (its talker drew no codes)."""
        return cls(np.zeros(0, dtype=np.float32), 0)
