"""Streaming Qwen3-Omni code2wav: codec frames to audio chunk by chunk, equal to what ``generate`` returns.

Contract: ``Code2WavStream`` (a ``BatchProgram``) takes ``CodecChunk``s and emits a ``WaveChunk`` per chunk of
frames, in order; the concatenation equals ``Qwen3OmniMoeCode2Wav.chunked_decode(codes, block, left_context)``
on all the frames (what ``Qwen3OmniMoeForConditionalGeneration.generate`` returns; a single whole-sequence
forward when the response has at most ``block`` frames) within float tolerance. ``Code2WavCompute(model)`` is
the engine's batched ``compute``: equally long windows of many requests in one forward.

Why chunks match: the vocoder is causal except for a few samples of look-ahead. Its transformer attends
within a sliding window (``attention_reach`` frames over all layers) and its convolutions reach
``conv_context`` frames back and ``lookahead`` frames ahead (``omni_serve.models.qwen3_omni.conv_reach``).
Chunk ``[s, e)`` is decoded as the window ``[s - conv_context - attention_reach, e + lookahead)`` for the
transformer and ``[s - conv_context, ...)`` for the convolutions (which cost most), never reaching before the start
of the reference block's own context (``chunked_decode`` restarts attention there); the convolutions' samples
``[(s - lo) * U, (e - lo) * U)`` are kept (U samples per frame, ``lo`` their first frame). At a block's end and at the end
of speech there is no look-ahead: the window ends there, as the reference block does, and keeps every sample.
The price of exact seams is waiting ``lookahead`` frames (2 by default, 160 ms) beyond a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omni_serve.engines.batch import BatchProgram
from omni_serve.graphs.qwen2_5_omni.replica.code2wav import WaveChunk
from omni_serve.graphs.qwen3_omni.messages import CodecChunk
from omni_serve.models.qwen3_omni import Qwen3OmniCode2Wav


@dataclass
class Code2WavRequest:
    first_chunk_codes: int = 4
    chunk_codes: int = 50
    block_codes: int = 300
    block_left_context: int = 25


@dataclass
class _Job:
    codes: torch.Tensor  # [G, n] the window's frames
    conv_from: int  # the first frame the convolutions run on
    keep: tuple[int, int | None]  # samples of the convolutions' output that are this chunk (None: to the end)


class Code2WavStream(BatchProgram):
    def __init__(self, model: Qwen3OmniCode2Wav, req: Code2WavRequest):
        self.model, self.req = model, req
        self.frames: list[list[int]] = []
        self.upstream_done = False
        self.start = 0  # frames whose audio was emitted
        self.emitted = False
        self.done = False
        self._pending_end = 0

    def feed(self, item: CodecChunk) -> None:
        self.frames.extend(item.frames)
        if item.end:
            self.upstream_done = True

    def close_input(self) -> None:
        self.upstream_done = True

    def release(self) -> None:
        self.frames = []

    def _plan(self) -> tuple[int, int, bool] | None:
        """(chunk end, window end, whether the window ends at the chunk's end) of the next chunk, or None while
        it waits for frames. A window never reaches past its reference block, nor past the end of speech."""
        r, n, s = self.req, len(self.frames), self.start
        block_end = (s // r.block_codes + 1) * r.block_codes
        end = min(s + (r.chunk_codes if s else r.first_chunk_codes), block_end)
        limit = block_end
        if self.upstream_done:
            end, limit = min(end, n), min(block_end, n)
        window_end = min(end + self.model.lookahead, limit)
        if n < window_end:
            return None
        return end, window_end, window_end == end

    def ready(self) -> bool:
        if self.done:
            return False
        return self._plan() is not None

    def work(self):
        end, window_end, edge = self._plan()
        if end <= self.start:  # upstream ended: nothing (more) to decode
            return (0,), None
        r, m = self.req, self.model
        block = self.start // r.block_codes * r.block_codes
        context = r.block_left_context if block - r.block_left_context > 0 else block  # chunked_decode's rule
        lo = max(block - context, self.start - m.conv_context - m.attention_reach)  # the transformer's window
        conv_lo = max(lo, self.start - m.conv_context)  # the convolutions' window
        self._pending_end = end
        codes = torch.tensor(self.frames[lo:window_end], dtype=torch.long).T
        u = m.samples_per_code
        keep = ((self.start - conv_lo) * u, None if edge else (end - conv_lo) * u)
        return (window_end - lo, conv_lo - lo), _Job(codes, conv_lo - lo, keep)

    def complete(self, result) -> list[WaveChunk]:
        if result is None:
            self.done = True
            return [] if self.emitted else [WaveChunk(np.zeros(0, dtype=np.float32), 0)]
        n = self._pending_end - self.start
        self.start = self._pending_end
        self.emitted = True
        self.done = self.upstream_done and self.start >= len(self.frames)
        return [WaveChunk(result.numpy(), n)]


class Code2WavCompute:
    """The batch engine's ``compute``: one forward for equally long windows, each trimmed to its chunk."""

    def __init__(self, model: Qwen3OmniCode2Wav):
        self.model = model

    def __call__(self, jobs: list[_Job | None]) -> list:
        real = [j for j in jobs if j is not None]  # one key: equally long windows, the same conv_from
        wavs = iter(self.model.decode(torch.stack([j.codes for j in real]), real[0].conv_from) if real else [])
        out = []
        for job in jobs:
            if job is None:
                out.append(None)
                continue
            lo, hi = job.keep
            out.append(next(wavs)[lo:hi].cpu())
        return out
