"""Streaming Qwen3-Omni code2wav: codec frames to audio chunk by chunk, equal to what ``generate`` returns.

Contract: ``Code2WavStream`` (a ``BatchProgram``) takes ``CodecChunk``s and emits a ``WaveChunk`` per chunk of
frames, in order; the concatenation equals ``Qwen3OmniMoeCode2Wav.chunked_decode(codes, block, left_context)``
on all the frames (what ``Qwen3OmniMoeForConditionalGeneration.generate`` returns; a single whole-sequence
forward when the response has at most ``block`` frames) within float tolerance. ``Code2WavCompute(model)`` is
the engine's ``compute``.

Each chunk's frames are fed to the request's ``VocoderStream`` (``omni_serve.models.qwen3_omni_vocoder``): the
vocoder keeps its attention cache and every convolution's left context, so a frame is decoded once and the samples
that come out are final. ``chunked_decode`` decodes blocks of ``block`` frames independently, each from
``left_context`` frames before it (whose samples it drops): at a block's first chunk the stream starts afresh on
that context and drops its samples the same way. Chunks grow from ``first_chunk_codes`` (early first audio)
threefold up to ``chunk_codes``; nothing waits for look-ahead frames (the vocoder holds back the part of the last
frame that is not final yet, as the whole decode does). With a ``pace`` (the client's playback), a later chunk whose
client would run dry within ``cut_lead_s`` goes at once with the frames here: the vocoder decodes frame by frame, so
a cut chunk is as exact as a whole one, and a client that started on a 2-frame chunk is not left waiting for a
chunk three times longer while the talker, shared with other streams, makes its frames (a stream already dry waits
for its whole chunk: it stalls once instead of again and again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_serve.engines.batch import BatchProgram
from omni_serve.kits.omni.replica.streams import PacedAudio, StreamedInput, WaveChunk
from omni_serve.families.qwen3_omni.messages import CodecChunk
from omni_serve.models.qwen3_omni import Qwen3OmniCode2Wav
from omni_serve.models.qwen3_omni_vocoder import VocoderStream

GROWTH = 3  # the next chunk at most this many times the frames already sent


@dataclass
class Code2WavRequest:
    first_chunk_codes: int = 2
    chunk_codes: int = 25
    block_codes: int = 300
    block_left_context: int = 25
    cut_lead_s: float = 0.4  # with a pace: a later chunk goes with the frames here this long before its client runs dry


@dataclass
class _Job:
    stream: VocoderStream
    codes: torch.Tensor  # [G, m] the frames to feed
    drop: int  # samples of the output that belong to the block's context (not this chunk's)


class Code2WavStream(PacedAudio, StreamedInput, BatchProgram):
    def __init__(self, model: Qwen3OmniCode2Wav, req: Code2WavRequest):
        self.model, self.req = model, req
        self.frames: list[list[int]] = []
        self.fed = 0  # frames fed (their audio emitted, but for the part of the last one that is not final)
        self.stream: VocoderStream | None = None
        self.emitted = False
        self.done = False
        self._pending_end = 0
        self._cut_to: int | None = None  # a cut decided by the client's lead, kept until its chunk is computed

    def take(self, chunk: CodecChunk) -> None:
        self.frames.extend(chunk.frames)

    def drop_inputs(self) -> None:
        self.frames = []
        self.stream = None
        self._cut_to = None

    def _chunk_end(self) -> int | None:
        """The end of the next chunk, or None while it waits for frames. A chunk never crosses a block."""
        r, n = self.req, len(self.frames)
        size = max(r.first_chunk_codes, min(r.chunk_codes, GROWTH * self.fed))
        end = min(self.fed + size, (self.fed // r.block_codes + 1) * r.block_codes)
        if self.upstream_done:
            end = min(end, n)
        if self._cut_to is not None:  # decided when it was found ready: the lead moves on, the chunk does not
            return self._cut_to
        if n < end and n > self.fed > 0 and self.pace is not None and 0 < self.pace.slack() <= r.cut_lead_s:
            self._cut_to = n
            return n
        return end if n >= end else None

    def ready(self) -> bool:
        return not self.done and (self.upstream_done or self._chunk_end() is not None)

    def work_size(self) -> float:
        end = self._chunk_end()
        return float(max((end or self.fed) - self.fed, 0))  # frames the vocoder decodes

    def work(self):
        end = self._chunk_end()
        if end is None or end <= self.fed:  # upstream ended: nothing (more) to decode
            return (0,), None
        r, start = self.req, self.fed
        block = start // r.block_codes * r.block_codes
        drop = 0
        if start == block:  # a new chunked_decode block: a fresh decode from its left context
            self.stream = VocoderStream()
            context = r.block_left_context if block - r.block_left_context > 0 else block
            start, drop = block - context, context * self.model.samples_per_code
        self._pending_end = end
        codes = torch.tensor(self.frames[start:end], dtype=torch.long).T
        return (end - start,), _Job(self.stream, codes, drop)

    def complete(self, result) -> list[WaveChunk]:
        if result is None:
            self.done = True
            return [] if self.emitted else [WaveChunk.empty()]
        n = self._pending_end - self.fed
        self.fed, self._cut_to = self._pending_end, None
        self.emitted = True
        self.done = self.upstream_done and self.fed >= len(self.frames)
        return [self.sent(WaveChunk(result.numpy(), n))]


class Code2WavCompute:
    """The batch engine's ``compute``: each request's new frames through its own stream, one after another (a
    stream's state is its own; and on CPU, batching the vocoder's large activations is slower per frame)."""

    def __init__(self, model: Qwen3OmniCode2Wav):
        self.model = model

    def __call__(self, jobs: list[_Job | None]) -> list:
        return [None if job is None else self.model.feed(job.stream, job.codes)[job.drop:].cpu() for job in jobs]
