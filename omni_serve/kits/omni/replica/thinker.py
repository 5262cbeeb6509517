"""Per-request programs of the Omni encoder and thinker stages, shared by the Omni families.

The thinker is an ``ARSequence`` run by ``omni_serve.engines.ar.AREngine`` (continuous batching); the encoder is a
``StageProgram``. Programs take their stage's call (turned into a ``ThinkerRequest``) and edge payloads, and emit
edge payloads (written downstream by the runner) and stage outputs (sent to the ingress): the types are in
``omni_serve.kits.omni.messages`` and, for the thinker -> talker stream, the family's messages. Tensors travel
through the connector, never in handle arguments.

The thinker runs in one of three roles (``ThinkerRole``), two graph layouts of the same code:
``aggregated`` (one stage: prompt and generation), or ``prefill`` + ``decode``. Prefill computes every
prompt row (the same forward, chunking and prefix caching as the aggregated thinker), never samples, and
hands off a ``PromptHandoff``; decode writes the imported KV into its own cache, samples the first token from the
imported logits with the request's seeded sampler and continues exactly as the aggregated thinker (text
outputs and the thinker -> talker stream). Sampling happens in one place only, so the outputs are those
of the aggregated thinker.

This is exactly the hand-off that transformers' ``Qwen2_5OmniForConditionalGeneration.generate`` builds in
one process, cut so the talker can start on the thinker's first chunk.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from omni_serve.engines.ar.kv_cache import block_hashes
from omni_serve.engines.ar.sequence import ARSequence, KVTransfer
from omni_serve.engines.base import StageProgram
from omni_serve.engines.constraints import TokenConstraint
from omni_serve.engines.sampling import Sampler, SamplingParams, token_logprobs
from omni_serve.graph.messages import Message, StreamChunk
from omni_serve.kits.omni.messages import (
    MediaEmbeddings, MediaInputs, MediaLayout, PromptHandoff, TextDelta, TokenLogprob,
)
from omni_serve.models.qwen2_5_omni import OmniEncoder, OmniThinker


class EncoderProgram(StageProgram):
    """One shot: audio features, image and video patches in, embeddings out."""

    def __init__(self, model: OmniEncoder):
        self.model = model
        self.inputs: MediaInputs | None = None
        self.done = False

    def feed(self, item: MediaInputs) -> None:
        self.inputs = item

    def ready(self) -> bool:
        return self.inputs is not None and not self.done

    def step(self) -> list[MediaEmbeddings]:
        x, out = self.inputs, MediaEmbeddings()
        if x.input_features is not None:
            out.audio = self.model.encode_audio(x.input_features, x.feature_attention_mask)
        if x.pixel_values is not None:
            out.image = self.model.encode_image(x.pixel_values, x.image_grid_thw)
        if x.pixel_values_videos is not None:
            out.video = self.model.encode_image(x.pixel_values_videos, x.video_grid_thw)
        self.done = True
        return [out]


@dataclass
class ThinkerRequest:
    input_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...] = ()
    media_layout: MediaLayout | None = None  # the prompt's media (M-RoPE); None: a text prompt
    expects_media: bool = False
    talker_voice_token: int | None = None  # set when a talker consumes this request's states
    talker_tokens: tuple[int, int] = (0, 0)  # (tts end, tts pad) thinker token ids
    chunk_size: int = 8
    first_chunk_size: int = 1
    media_token_ids: tuple[int, ...] = ()
    block_size: int = 16  # KV block size of the engine (for prefix-sharing hashes)
    forced_reply: tuple[int, ...] = ()  # the reply to speak instead of sampling one (its end token last)
    logprobs: int | None = None  # each sampled token's log-probability with this many alternatives; None: none
    constraint: TokenConstraint | None = None  # the grammar the reply must follow (``engines.constraints``)


def rope_kwargs(layout: MediaLayout | None) -> dict:
    """The models' ``prompt_positions`` keyword arguments for a prompt's media (none for a text prompt)."""
    return {} if layout is None else layout.rope_kwargs()


class ThinkerRole(str, enum.Enum):
    """What a thinker stage does with a request (see the module doc)."""

    AGGREGATED = "aggregated"  # prompt and generation in one stage
    PREFILL = "prefill"  # prompt only; hands its KV off to decode
    DECODE = "decode"  # adopts the hand-off; generation


class OmniThinkerSequence(ARSequence):
    """Prompt (text + media embeddings, M-RoPE positions) in; text tokens and talker states out.

    Each Omni family subclasses it: ``chunk_type`` (the thinker_talker edge's payload) and ``_talker_head`` are
    the family's; ``_needs_hidden``, ``_build_prompt``, ``_feed_back`` and ``_collect_hidden`` are hooks a family
    may override (Qwen3-Omni's does).
    """

    chunk_type: type[StreamChunk]  # the thinker_talker edge's payload (``states`` and a first-chunk ``head``)

    def __init__(self, model: OmniThinker, tokenizer, req: ThinkerRequest,
                 role: ThinkerRole = ThinkerRole.AGGREGATED):
        super().__init__(model.row_size, model.position_rows, model.dtype)
        self.model, self.tok, self.req, self.role = model, tokenizer, req, ThinkerRole(role)
        self.sampler = Sampler(req.sampling)
        # the prompt is built once media arrived (none expected: at once); decode adopts it from prefill
        self.media: MediaEmbeddings | None = (None if req.expects_media or self.role is ThinkerRole.DECODE
                                              else MediaEmbeddings())
        self.prompt_len = len(req.input_ids)
        self.max_rows = self.prompt_len + req.max_new_tokens
        self.feeds_talker = req.talker_voice_token is not None
        self.wants_hidden = self._needs_hidden()
        self.last_logits: torch.Tensor | None = None  # prefill: next-token logits of the last prompt row
        if self.role is ThinkerRole.PREFILL:
            self.max_rows = self.prompt_len
            self.export_kv_rows = self.prompt_len
        self.generated: list[int] = []
        self.text = ""
        self.sent = 0
        self.delta = 0
        self.prompt_states: torch.Tensor | None = None  # [L, H] thinker prompt embeds (media zeroed) + hidden
        self.hidden_done = 0  # rows whose hidden states were consumed (not redone after preemption)
        self.pending_states: list[torch.Tensor] = []
        self.first_sent = False
        self.talker_tokens: torch.Tensor | None = None  # [3, H]: embeddings of the voice bos, tts end, tts pad
        self.finish_reason: str | None = None
        self.max_stop = max((len(s) for s in req.stop), default=0)
        if not req.expects_media and not self.wants_hidden and self.role is not ThinkerRole.DECODE:
            # Prompt-prefix sharing needs no prompt hidden states and media-free prompts (token id = content).
            # Decode computes no prompt rows: it imports them (and does not offer them for sharing).
            self.prefix_hashes = block_hashes(req.input_ids[:self.prompt_len - 1], req.block_size)

    def _needs_hidden(self) -> bool:
        """Whether the engine must return this request's hidden states (Qwen2.5-Omni: whenever a talker
        consumes the request, since its states are hidden state + embedding)."""
        return self.feeds_talker

    def feed(self, item: MediaEmbeddings | PromptHandoff) -> None:
        if self.role is ThinkerRole.DECODE:
            self._adopt(item)
        else:
            self.media = item

    def ready(self) -> bool:
        return not self.done and ((self.num_rows == 0 and self.media is not None) or self.num_pending() > 0)

    def release(self) -> None:
        self.pending_states = []
        self.prompt_states = None
        self.last_logits = None
        self.kv_import = None

    def poll(self) -> None:
        if self.num_rows == 0 and self.media is not None:
            self._build_prompt()
            if self.role is not ThinkerRole.PREFILL:
                self._force_reply()

    def _force_reply(self) -> None:
        """A forced reply: every reply token but the last is fed back as generation would, so one prefill
        computes the prompt and the reply together; ``on_computed`` then ends the request without sampling."""
        for token in self.req.forced_reply[:-1]:
            self._feed_back(token)

    def _build_prompt(self) -> None:
        m, req = self.model, self.req
        ids = torch.tensor([req.input_ids])
        embeds = m.embed(ids)
        cfg = m.config
        for key, token in (("audio", cfg.audio_token_index), ("image", cfg.image_token_index),
                           ("video", cfg.video_token_index)):
            feats = getattr(self.media, key)
            if feats is not None:
                mask = (ids == token).unsqueeze(-1).to(embeds.device)
                if int(mask.sum()) != feats.shape[0]:
                    raise ValueError(f"{key}: {int(mask.sum())} placeholder tokens for {feats.shape[0]} embeddings")
                embeds = embeds.masked_scatter(mask, feats.to(embeds.dtype))
        positions, self.delta = m.prompt_positions(ids, **rope_kwargs(req.media_layout))
        self.append(embeds[0], positions)
        self.media = MediaEmbeddings()
        if self.feeds_talker:
            media_mask = torch.isin(ids[0], torch.tensor(req.media_token_ids)).view(-1, 1)
            self.prompt_states = embeds[0].masked_fill(media_mask.to(embeds.device), 0.0).clone()
            self._talker_extras()

    def _talker_extras(self) -> None:
        req = self.req
        self.talker_tokens = self.model.embed(torch.tensor([[req.talker_voice_token, *req.talker_tokens]]))[0]

    # -- prefill/decode hand-off (see the module doc) -------------------------------------------------------
    def kv_exported(self, kv: KVTransfer) -> list[PromptHandoff]:
        """Prefill: every prompt row is computed; hand the prompt off to decode and end the request."""
        n = self.prompt_len
        emb, pos = self.rows(0, n)
        handoff = PromptHandoff(k=kv.k, v=kv.v, logits=self.last_logits, embeds=emb.clone(), positions=pos.clone(),
                                delta=self.delta, prompt_states=self.prompt_states if self.feeds_talker else None)
        self.done = True
        return [handoff]

    def _adopt(self, handoff: PromptHandoff) -> None:
        """Decode: take over a prompt prefilled elsewhere (rows, M-RoPE delta, KV to import, talker prompt)."""
        if self.num_rows:
            raise ValueError("the thinker's prompt hand-off arrived twice")
        emb, pos, k = handoff.embeds, handoff.positions, handoff.k
        if emb.shape[0] != self.prompt_len or pos.shape[1] != self.prompt_len or k.shape[1] != self.prompt_len:
            raise ValueError(f"prompt hand-off has {emb.shape[0]} rows / {k.shape[1]} KV rows for a "
                             f"{self.prompt_len}-token prompt")
        if self.feeds_talker and handoff.prompt_states is None:
            raise ValueError("prompt hand-off lacks the prompt states the talker needs")
        self.append(emb, pos)
        self.delta = handoff.delta
        # logits where the aggregated thinker's are (the model's device), so sampling runs the same way
        self.kv_import = KVTransfer(k, handoff.v, handoff.logits.to(self.model.device))
        if self.feeds_talker:
            self.prompt_states = handoff.prompt_states.to(self.model.device, copy=True)
            self.hidden_done = self.prompt_len  # prompt hidden states came with the hand-off
            self._talker_extras()
        self._force_reply()

    def _collect_hidden(self, start: int, end: int, hidden: torch.Tensor) -> None:
        lo, prompt_end = max(start, self.hidden_done), min(end, self.prompt_len)
        if lo < prompt_end:
            self.prompt_states[lo:prompt_end] += hidden[lo - start:prompt_end - start]
        for row in range(max(lo, self.prompt_len), end):
            # the state of a generated token the thinker fed back: its hidden state + its embedding
            self.pending_states.append(hidden[row - start] + self.rows(row, row + 1)[0][0])
        self.hidden_done = max(self.hidden_done, end)

    def on_computed(self, start, end, hidden, logits) -> list[StreamChunk | TextDelta]:
        if hidden is not None and self.wants_hidden:
            self._collect_hidden(start, end, hidden)
        if logits is None:
            return []
        if self.role is ThinkerRole.PREFILL:  # decode samples (once, with the request's seeded sampler)
            self.last_logits = logits.clone()  # a row of the batch's logits: do not ship the whole batch
            return []
        if self.req.forced_reply:
            return self._forced_done(end)
        if self.req.constraint is not None:  # before logprobs too: vLLM's raw logprobs see its grammar mask
            logits = self.req.constraint.mask(logits)
        token = self.sampler.select(logits, self.generated)
        logprob = None
        if self.req.logprobs is not None:
            chosen, top = token_logprobs(logits, token, self.req.logprobs)
            logprob = [TokenLogprob(logprob=chosen, top=top)]
        self.generated.append(token)
        if token in self.req.stop_token_ids:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.req.max_new_tokens:
            self.finish_reason = "length"
        delta = TextDelta(token_ids=[token], text=self._text_delta(), logprobs=logprob)
        if self.finish_reason:
            self.done = True
            delta.finish_reason = self.finish_reason
        else:
            if self.req.constraint is not None:
                self.req.constraint.advance(token)
            self._feed_back(token)
        downstream = self._talker_chunk()
        return [delta] if downstream is None else [downstream, delta]

    def _forced_done(self, end: int) -> list[StreamChunk | TextDelta]:
        """The forced reply's rows are computed (``end`` is the last row): the reply is the forced tokens."""
        if end < self.num_rows:  # imported prompt logits (decode role): the forced rows are still to compute
            return []
        self.generated = list(self.req.forced_reply)
        self.finish_reason, self.done = "stop", True
        delta = TextDelta(token_ids=self.generated, text=self._text_delta(), finish_reason="stop")
        downstream = self._talker_chunk()
        return [delta] if downstream is None else [downstream, delta]

    def _feed_back(self, token: int) -> None:
        """Append the row of a sampled token that generation continues from."""
        self.append(self.model.embed(torch.tensor([token]))[0:1], self.model.step_positions(self.num_rows, self.delta))

    def _text_delta(self) -> str:
        ids = [t for t in self.generated if t not in self.req.stop_token_ids]
        text = self.tok.decode(ids, skip_special_tokens=True)
        if self.req.stop:
            hits = [text.find(s) for s in self.req.stop if s in text]
            if hits:
                text = text[: min(hits)]
                self.finish_reason = "stop"
        self.text = text
        if self.finish_reason:
            limit = len(text)
        else:
            limit = len(text) - max(self.max_stop - 1, 0)
            while limit > self.sent and text[limit - 1] == "\ufffd":  # incomplete UTF-8 sequence
                limit -= 1
        if limit <= self.sent:
            return ""
        delta, self.sent = text[self.sent:limit], limit
        return delta

    def _talker_chunk(self) -> StreamChunk | None:
        if not self.feeds_talker:
            return None
        size = self.req.chunk_size if self.first_sent else self.req.first_chunk_size
        if not self.done and len(self.pending_states) < size:
            return None
        states = torch.stack(self.pending_states) if self.pending_states else None
        self.pending_states = []
        chunk = self.chunk_type(states=states, end=self.done)
        if not self.first_sent:
            chunk.head = self._talker_head()
            self.first_sent = True
        return chunk

    def _talker_head(self) -> Message:
        """What the talker's prompt is built from (sent with the first chunk)."""
        raise NotImplementedError
