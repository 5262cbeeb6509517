"""The lifecycle of the Omni programs fed by a streamed edge (the talker from the thinker, code2wav from the
talker), and what code2wav hands its runner.

Contract: a program mixes in ``StreamedInput`` and supplies ``take(chunk)`` (add one upstream chunk's content to
its state) and ``drop_inputs()`` (drop every upstream tensor). The engine's pump then drives it the same way for
every family: ``feed`` takes a chunk and marks the stream ended on its last chunk (``end``), ``close_input`` ends
it when the upstream call ends without one, ``fresh`` tells the program inputs arrived since it last looked, and
``release`` drops the inputs when the request ends, so zero-copy connectors get their memory back. An
autoregressive talker is a ``StreamedSequence``: ready when inputs arrived or rows are pending.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omni_serve.engines.ar.sequence import ARSequence
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


class StreamedSequence(StreamedInput, ARSequence):
    """An autoregressive program fed by a stream: it has work when inputs arrived (``poll`` turns them into rows)
    or rows are pending."""

    def ready(self) -> bool:
        return not self.done and (self.fresh or self.num_pending() > 0)


@dataclass
class WaveChunk:
    """One synthesized chunk, handed to the code2wav runner in-process (it encodes it for the client)."""

    audio: np.ndarray  # float32 samples
    num_codes: int  # codec frames (Qwen2.5-Omni: tokens) the chunk's audio covers

    @classmethod
    def empty(cls) -> "WaveChunk":
        """The chunk a response without audio ends with (its talker drew no codes)."""
        return cls(np.zeros(0, dtype=np.float32), 0)
