"""Per-request state machines of the Qwen3-Omni thinker and talker (run by the AR engine).

``Qwen3ThinkerSequence`` is the Omni kit's thinker program (roles, chunked prefill, preemption, the prefill ->
decode hand-off, stops and text deltas: ``omni_serve.kits.omni.replica.thinker``) with Qwen3-Omni's prompt and
talker inputs:
- input rows carry the deepstack features of image and video tokens (``Qwen3OmniThinker``'s row layout);
- the talker reads, per prompt row of the user turns, the thinker's input embedding (text rows) or its hidden
  state after ``accept_hidden_layer`` (media rows: the only hidden states the engine is asked for), the
  embeddings of the assistant turn's rows, and then the embedding of each generated token the thinker feeds
  back, streamed as soon as it is sampled. This is the split of ``Qwen3OmniMoeForConditionalGeneration.generate``
  (``_get_talker_user_parts`` / ``_get_talker_assistant_parts``) that lets the talker start on the first token.

``Qwen3TalkerSequence`` draws one codec frame per step: the talker's forward gives the first codebook; the code
predictor's G-1 inner steps give the residual codebooks, run as the engine's batched follow-up for every request
of the step (``ARSequence.followup``). The next input row is the sum of the frame's code embeddings plus the
projected text vector of that step (the next generated token's embedding, then tts eos, then tts pad), as
``generate`` feeds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omni_serve.engines.sampling import Sampler, SamplingParams
from omni_serve.families.qwen3_omni.messages import (
    CodecChunk, CodecDelta, MediaEmbeddings, MediaLayout, TalkerHead, ThinkerStates,
)
from omni_serve.kits.omni.replica.streams import StreamedSequence
from omni_serve.kits.omni.replica.thinker import OmniThinkerSequence, ThinkerRole, rope_kwargs
from omni_serve.models.qwen3_omni import CodeFrame, FrameCodes, Qwen3OmniTalker

ASSISTANT_HEAD_ROWS = 4  # <|im_start|> assistant \n + the first generated token: the talker prompt's text part


def user_turn_mask(ids: torch.Tensor, im_start: int, user: int) -> torch.Tensor:
    """Rows in user turns: a row belongs to the turn of the last ``<|im_start|>`` at or before it, whose role is
    the token after it (``generate``'s own rule)."""
    pos = torch.arange(ids.shape[0])
    starts = torch.where(ids == im_start, pos, torch.full_like(pos, -1))
    previous = torch.cummax(starts, dim=0).values.clamp_min(0)
    return ids[(previous + 1).clamp_max(ids.shape[0] - 1)] == user


def assistant_start(ids: list[int], im_start: int, assistant: int) -> int:
    """The last ``<|im_start|>assistant`` row of the prompt."""
    for i in range(len(ids) - 2, -1, -1):
        if ids[i] == im_start and ids[i + 1] == assistant:
            return i
    raise ValueError("the prompt has no assistant turn for the talker to speak")


class Qwen3ThinkerSequence(OmniThinkerSequence):
    chunk_type = ThinkerStates

    def _needs_hidden(self) -> bool:
        # media rows of the prompt: the talker reads their accept-layer hidden states (decode gets them from prefill)
        return self.feeds_talker and self.req.expects_media and self.role is not ThinkerRole.DECODE

    def _build_prompt(self) -> None:
        m, req = self.model, self.req
        ids = torch.tensor(req.input_ids)
        rows = m.rows(m.embed(ids))
        h = m.hidden_size
        for key, token, width in (("audio", m.config.audio_token_id, h),
                                  ("image", m.config.image_token_id, m.row_size),
                                  ("video", m.config.video_token_id, m.row_size)):
            feats = getattr(self.media, key)
            if feats is not None:
                mask = ids == token
                if int(mask.sum()) != feats.shape[0]:
                    raise ValueError(f"{key}: {int(mask.sum())} placeholder tokens for {feats.shape[0]} embeddings")
                rows[mask.to(rows.device), :width] = feats.to(rows.device, rows.dtype)
        positions, self.delta = m.prompt_positions(ids.view(1, -1), **rope_kwargs(req.media_layout))
        self.append(rows, positions)
        self.media = MediaEmbeddings()
        if self.feeds_talker:
            self.prompt_states = rows[:, :h].clone()  # media rows get their accept-layer hidden state
            self._talker_extras()

    def _collect_hidden(self, start: int, end: int, hidden: torch.Tensor) -> None:
        lo, prompt_end = max(start, self.hidden_done), min(end, self.prompt_len)
        if lo < prompt_end:
            ids = torch.tensor(self.req.input_ids[lo:prompt_end])
            media = torch.isin(ids, torch.tensor(self.req.media_token_ids)).to(hidden.device)
            part = self.prompt_states[lo:prompt_end]
            part[media] = hidden[lo - start:prompt_end - start][media].to(part.dtype)
        self.hidden_done = max(self.hidden_done, end)

    def _feed_back(self, token: int) -> None:
        emb = self.model.embed(torch.tensor([token]))
        self.append(self.model.rows(emb), self.model.step_positions(self.num_rows, self.delta))
        if self.feeds_talker:
            self.pending_states.append(emb[0])

    def _talker_head(self) -> TalkerHead:
        m, ids = self.model, torch.tensor(self.req.input_ids)
        user = user_turn_mask(ids, m.im_start_token_id, m.user_token_id)
        start = assistant_start(self.req.input_ids, m.im_start_token_id, m.assistant_token_id)
        media = torch.isin(ids, torch.tensor(self.req.media_token_ids))
        return TalkerHead(user=self.prompt_states[user.to(self.prompt_states.device)].clone(),
                          user_is_media=media[user], user_ids=ids[user].tolist(),
                          assistant=self.prompt_states[start:].clone(), tts=self.talker_tokens)


@dataclass
class TalkerRequest:
    voice_id: int  # the talker's speaker codec id
    max_new_tokens: int
    sampling: SamplingParams  # first codebook
    predictor_sampling: SamplingParams  # residual codebooks
    chunk_size: int = 5
    first_chunk_size: int = 4
    media_layout: MediaLayout | None = None  # the prompt's media (the talker's M-RoPE); None: a text prompt
    return_frames: bool = True  # also output CodecDelta (the frames, for the ingress)


class Qwen3TalkerSequence(StreamedSequence):
    """Codec frames from the thinker's vectors (see the module doc)."""

    wants_hidden = True  # the code predictor starts from the talker's last hidden state

    def __init__(self, model: Qwen3OmniTalker, req: TalkerRequest):
        super().__init__(model.embedding_size, model.position_rows, model.dtype)
        self.model, self.req = model, req
        self.sampler = Sampler(req.sampling)
        self.predictor_sampler = Sampler(req.predictor_sampling)
        self.head: TalkerHead | None = None
        self.text: list[torch.Tensor] = []  # thinker vectors of the assistant turn: prompt rows, then fed-back tokens
        self.history: list[int] = []  # first-codebook codes drawn (repetition penalty)
        self.unsent: list[list[int]] = []
        self.sent_any = False
        self.steps = 0  # first-codebook codes drawn
        self.delta = 0
        self.next_codes: torch.Tensor | None = None  # the last frame's embedding, waiting for its text vector

    def take(self, chunk: ThinkerStates) -> None:
        if chunk.head is not None:
            self.head = chunk.head
            self.text.extend(chunk.head.assistant.unbind(0))
        if chunk.states is not None:
            self.text.extend(chunk.states.unbind(0))

    def drop_inputs(self) -> None:
        self.text = []
        self.head = None
        self.next_codes = None

    def _text_vector(self, step: int) -> torch.Tensor | None:
        """The thinker vector talker step ``step`` adds: the assistant turn's row ``4 + step``, then tts eos,
        then tts pad; None while the thinker has not produced it yet."""
        i = ASSISTANT_HEAD_ROWS + step
        if i < len(self.text):
            return self.text[i]
        if not self.upstream_done:
            return None
        _, eos, pad = self.head.tts
        return eos if i == len(self.text) else pad

    def poll(self) -> None:
        self.fresh = False
        if self.done:
            return
        if self.num_rows == 0:
            self._start()
        elif self.next_codes is not None:
            vector = self._text_vector(self.steps - 1)
            if vector is not None:
                row = self.next_codes + self.model.project_text(vector.view(1, -1))[0]
                self.append(row.view(1, -1), self.model.step_positions(self.num_rows, self.delta))
                self.next_codes = None

    def _start(self) -> None:
        if self.head is None:
            if self.upstream_done:
                raise ValueError("the thinker's stream ended before its first chunk")
            return
        if len(self.text) < ASSISTANT_HEAD_ROWS:
            if not self.upstream_done:
                return
            # The thinker's reply is one token (an immediate stop, or max_tokens=1): nothing to speak (transformers'
            # generate cannot build a talker prompt either). The answer is its text with empty audio.
            self.done = True
            self.outbox = [CodecChunk(frames=[], end=True)] + ([CodecDelta(frames=[])] if self.req.return_frames else [])
            return
        h, req = self.head, self.req
        rows = self.model.prompt_rows(h.user, h.user_is_media, torch.stack(self.text[:ASSISTANT_HEAD_ROWS]),
                                      req.voice_id, h.tts)
        positions, self.delta = self.model.prompt_positions(h.user_ids, **rope_kwargs(req.media_layout))
        self.max_rows = rows.shape[0] + req.max_new_tokens
        self.append(rows, positions)

    def on_computed(self, start, end, hidden, logits) -> list[CodecChunk | CodecDelta]:
        if logits is None:
            return []
        self.steps += 1
        code = self.sampler.select(logits, self.history)
        self.history.append(code)
        if code == self.model.codec_eos or self.steps >= self.req.max_new_tokens:
            # generate stops here: a last first-codebook code (at the step limit) gets no residuals, no frame
            self.done = True
            return self._chunk()
        self.followup = CodeFrame(hidden[-1], code, self.predictor_sampler)
        return []

    def on_followup(self, result: FrameCodes) -> list[CodecChunk | CodecDelta]:
        self.unsent.append(result.codes)
        self.next_codes = result.embedding
        self.poll()
        return self._chunk()

    def _chunk(self) -> list[CodecChunk | CodecDelta]:
        size = self.req.chunk_size if self.sent_any else self.req.first_chunk_size
        if not self.done and len(self.unsent) < size:
            return []
        chunk = CodecChunk(frames=self.unsent, end=self.done)
        self.unsent, self.sent_any = [], True
        self.codes_sent(len(chunk.frames))
        return [chunk, CodecDelta(frames=chunk.frames)] if self.req.return_frames else [chunk]
