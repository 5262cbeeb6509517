"""Per-request programs of the Qwen2.5-Omni stages that are this family's: the thinker's talker stream and the
talker.

``ThinkerSequence`` is the Omni kit's thinker (``omni_serve.kits.omni.replica.thinker``: roles, chunked
prefill, preemption, the prefill -> decode hand-off) emitting Qwen2.5-Omni's thinker -> talker stream
(``ThinkerStates``, whose first chunk's ``TalkerHead`` carries the prompt states and the voice's tokens).
``TalkerSequence`` is an ``ARSequence`` drawing codec tokens from the thinker's states; code2wav streams in
``code2wav.py``. The message types are in ``omni_serve.families.qwen2_5_omni.messages``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from omni_serve.engines.sampling import Sampler, SamplingParams
from omni_serve.families.qwen2_5_omni.messages import CodecChunk, CodecDelta, TalkerHead, ThinkerStates
from omni_serve.kits.omni.replica.thinker import (  # noqa: F401 - the shared programs, importable from here
    EncoderProgram, OmniThinkerSequence, ThinkerRequest, ThinkerRole,
)
from omni_serve.kits.omni.replica.streams import StreamedSequence
from omni_serve.models.qwen2_5_omni import OmniTalker


class ThinkerSequence(OmniThinkerSequence):
    """The Omni thinker with Qwen2.5-Omni's talker stream (see the module doc)."""

    chunk_type = ThinkerStates

    def _talker_head(self) -> TalkerHead:
        """What the talker's prompt is built from (sent with the first chunk)."""
        bos, eos, pad = self.talker_tokens
        return TalkerHead(prompt=self.prompt_states, bos=bos, eos=eos, pad=pad, first_token=self.generated[0])



@dataclass
class TalkerRequest:
    max_new_tokens: int
    sampling: SamplingParams
    chunk_size: int = 16
    first_chunk_size: int = 4


class TalkerSequence(StreamedSequence):
    """Codec tokens from the thinker's states; decode step j consumes reply state j (see module doc)."""

    def __init__(self, model: OmniTalker, req: TalkerRequest):
        super().__init__(model.embedding_size, model.position_rows, model.dtype)
        self.model, self.req = model, req
        self.sampler = Sampler(req.sampling)
        self.head: TalkerHead | None = None
        self.states: list[torch.Tensor] = []
        self.history: list[int] = []
        self.codes: list[int] = []
        self.unsent: list[int] = []
        self.sent_any = False
        self.steps = 0  # codec tokens sampled
        self.first_code_at: float | None = None  # time.monotonic() of the first code sampled

    def take(self, chunk: ThinkerStates) -> None:
        if chunk.head is not None:
            self.head = chunk.head
            self.max_rows = chunk.head.prompt.shape[0] + 2 + self.req.max_new_tokens
        if chunk.states is not None:
            self.states.extend(chunk.states.unbind(0))

    def drop_inputs(self) -> None:
        self.states = []
        self.head = None

    def _reply(self, j: int) -> torch.Tensor | None:
        """Reply state j: thinker state j+1, then the tts end embedding, then pad forever."""
        if j + 1 < len(self.states):
            return self.states[j + 1]
        if not self.upstream_done:
            return None
        return self.head.eos if j + 1 == len(self.states) else self.head.pad

    def poll(self) -> None:
        self.fresh = False
        if self.done:
            return
        if self.num_rows == 0:
            if self.head is None and self.upstream_done:
                raise ValueError("the thinker's stream ended before its first chunk")
            if self.head is None or not (self.states or self.upstream_done):
                return
            if not self.states:
                # The thinker's reply is one token (an immediate stop, or max_tokens=1): no reply state to
                # condition speech on (transformers' generate has none either). The answer is its text
                # with empty audio, not an error.
                self.done = True
                self.outbox = [CodecChunk(codes=[], end=True), CodecDelta(codes=[])]
                return
            h = self.head
            rows = torch.cat([h.prompt, h.bos.view(1, -1), self.states[0].view(1, -1)])
            self.history = self.model.prompt_codec_ids(h.prompt.shape[0])
            self.append(rows, self.model.positions(0, rows.shape[0]))
        elif self.num_rows == self.logits_done:  # the last sampled code waits for its reply state
            reply = self._reply(self.steps - 1)
            if reply is not None:
                row = self.model.embed_codes([self.history[-1]]) + reply.view(1, -1).to(self.model.device)
                self.append(row, self.model.positions(self.num_rows, 1))

    def _rate(self) -> float | None:
        """Codes per second since the first code (None before a second one)."""
        elapsed = time.monotonic() - self.first_code_at if self.first_code_at is not None else 0.0
        return (len(self.codes) - 1) / elapsed if len(self.codes) > 1 and elapsed > 0 else None

    def on_computed(self, start, end, hidden, logits) -> list[CodecChunk | CodecDelta]:
        if logits is None:
            return []
        self.steps += 1
        code = self.sampler.select(logits, self.history)
        self.history.append(code)
        stop = code in self.model.stop_ids
        if not stop:
            self.codes.append(code)
            self.unsent.append(code)
            if self.first_code_at is None:
                self.first_code_at = time.monotonic()
        self.done = stop or self.steps >= self.req.max_new_tokens
        if not self.done:
            self.poll()
        size = self.req.chunk_size if self.sent_any else self.req.first_chunk_size
        if not self.done and len(self.unsent) < size:
            return []
        chunk = CodecChunk(codes=self.unsent, end=self.done, codes_per_s=self._rate())
        self.unsent, self.sent_any = [], True
        self.codes_sent(len(chunk.codes))
        return [chunk, CodecDelta(codes=chunk.codes)]
