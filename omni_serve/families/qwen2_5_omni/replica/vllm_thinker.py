"""The Qwen2.5-Omni thinker on vLLM (``stages.thinker.engine.backend: vllm``, layout ``aggregated_vllm``).

Same contract as the native ``ThinkerRunner``: a ``ThinkerCall`` in; ``TextDelta``s out to the ingress and, when a
talker consumes the request, ``ThinkerStates`` on ``thinker_talker`` with exactly the tensors the native thinker
sends (see ``messages``): the first chunk's ``TalkerHead`` (prompt rows: input embeddings with media rows zeroed
plus final hidden states; the thinker embeddings of the voice's bos, tts end and tts pad tokens; the first
token), then ``hidden + embedding`` of every generated token the thinker fed back, in chunks of the edge's sizes.

What differs is who computes: vLLM's ``Qwen2_5OmniThinkerForConditionalGeneration`` runs the audio and vision
towers and the decoder. It gets the decoded media (``RawMedia`` on ``ingress_thinker``) and the prompt with one
placeholder token per media item: its processor (transformers' ``Qwen2_5OmniProcessor``) computes the features,
expands the placeholders and the multimodal rope positions; the runner checks that the expanded prompt equals
the ids the ingress computed. Hidden states come from ``omni_serve.engines.vllm_engine.tap``.

Sampling is vLLM's: greedy output equals the native engine's and transformers'; a seeded sampled request is
reproducible on vLLM but draws different tokens than the native sampler. ``ignore_eos`` is set so only the
call's stop tokens end the text, as in the native thinker.

The talker stays on the native engine: stock vLLM has no Qwen2.5-Omni talker model class, takes no per-step
input states from another model (the talker's input at step j is its codec embedding plus thinker state j), and
its talker rope would need the thinker's prompt positions; none of that is a supported vLLM input.
"""

from __future__ import annotations

from typing import AsyncIterator

import numpy as np
import torch

from omni_serve.engines.vllm_engine.engine import VllmRequest
from omni_serve.families.qwen2_5_omni.messages import (
    RawMedia, TalkerHead, TextDelta, ThinkerCall, ThinkerStates, TokenLogprob,
)
from omni_serve.graph.runner import StageRunner

TALKER_EDGE = "thinker_talker"


class VllmThinkerModel:
    """What the replica itself needs of the checkpoint (vLLM loads the weights): config, and the thinker
    embedding rows of the talker's special tokens, read on demand from the safetensors files."""

    modules: dict = {}

    def __init__(self, checkpoint: str, dtype: torch.dtype):
        from omni_serve.models.qwen2_5_omni_layout import load_config

        self.checkpoint, self.dtype = checkpoint, dtype
        cfg = load_config(checkpoint).thinker_config
        self.media_token_ids = (cfg.audio_token_index, cfg.image_token_index, cfg.video_token_index)
        self._rows: dict[int, torch.Tensor] = {}

    def embedding_rows(self, token_ids: list[int]) -> torch.Tensor:
        missing = [t for t in token_ids if t not in self._rows]
        if missing:
            from omni_serve.models.loading import read_tensor_rows

            rows = read_tensor_rows(self.checkpoint, "thinker.model.embed_tokens.weight", missing)
            self._rows.update({t: r.to(self.dtype) for t, r in zip(missing, rows)})
        return torch.stack([self._rows[t] for t in token_ids])


def collapse_placeholders(input_ids: list[int], media_token_ids: tuple[int, ...]) -> list[int]:
    """The prompt with each run of one media placeholder token shortened to a single token (what vLLM expands)."""
    out: list[int] = []
    for token in input_ids:
        if token in media_token_ids and out and out[-1] == token:
            continue
        out.append(token)
    return out


def vllm_media(media: RawMedia) -> dict:
    """``multi_modal_data`` for vLLM: (samples, rate) per clip, a PIL image per image."""
    import PIL.Image

    data: dict = {}
    if media.audio is not None:
        clips = torch.split(media.audio, media.audio_lengths)
        data["audio"] = [(clip.numpy().astype(np.float32), 16000) for clip in clips]
    if media.images is not None:
        sizes = [h * w * 3 for h, w in media.image_sizes]
        pixels = torch.split(media.images, sizes)
        data["image"] = [PIL.Image.fromarray(p.numpy().reshape(h, w, 3)) for p, (h, w) in zip(pixels, media.image_sizes)]
    return data


class TalkerStream:
    """Turns the tapped rows of one request into ``ThinkerStates`` chunks (the native thinker's chunking)."""

    def __init__(self, model: VllmThinkerModel, call: ThinkerCall, rows, chunk_size: int, first_chunk_size: int,
                 timeout_s: float):
        self.model, self.call, self.rows = model, call, rows
        self.chunk_size, self.first_chunk_size, self.timeout_s = chunk_size, first_chunk_size, timeout_s
        self.prompt_len = len(call.input_ids)
        self.head: TalkerHead | None = None
        self.pending: list[torch.Tensor] = []
        self.fed = 0  # generated tokens whose states were taken
        self.head_sent = False

    async def update(self, generated: list[int], done: bool) -> ThinkerStates | None:
        """The chunk to send after ``generated`` tokens (None: not yet a full chunk)."""
        if self.head is None:
            self.head = await self._head(generated[0])
        fed = len(generated) - 1  # every generated token but the last was fed back (computed)
        if fed > self.fed:
            hidden, embeds = await self.rows.take(fed - self.fed, self.timeout_s)
            self.pending.extend((hidden + embeds).to(self.model.dtype).unbind(0))
            self.fed = fed
        size = self.chunk_size if self.head_sent else self.first_chunk_size
        if not done and len(self.pending) < size:
            return None
        chunk = ThinkerStates(states=torch.stack(self.pending) if self.pending else None, end=done)
        self.pending = []
        if not self.head_sent:
            chunk.head, self.head_sent = self.head, True
        return chunk

    async def _head(self, first_token: int) -> TalkerHead:
        hidden, embeds = await self.rows.take(self.prompt_len, self.timeout_s)
        ids = torch.tensor(self.call.input_ids)
        media = torch.isin(ids, torch.tensor(self.model.media_token_ids)).view(-1, 1)
        prompt = (embeds.masked_fill(media, 0.0) + hidden).to(self.model.dtype)
        t = self.call.talker
        bos, eos, pad = self.model.embedding_rows([t.voice_token, t.tts_end_token, t.tts_pad_token])
        return TalkerHead(prompt=prompt, bos=bos, eos=eos, pad=pad, first_token=first_token)


class VllmThinkerRunner(StageRunner):
    def load(self) -> VllmThinkerModel:
        return VllmThinkerModel(self.spec.checkpoint, self.engine_spec.torch_dtype())

    def engine_options(self):
        # the vllm engine kind (omni_serve.engines.registry), tapping the hidden states the talker needs
        return {"max_model_len": self.stage_spec.params.max_model_len, "tap": True}

    def sampling_params(self, call: ThinkerCall):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        from omni_serve.engines.vllm_engine.tap import TAP_KEY

        s = call.sampling
        if call.forced_reply:  # the reply is computed with the prompt: one token is drawn, and dropped
            return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                                  extra_args={TAP_KEY: True} if call.talker is not None else None)
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, seed=s.seed, max_tokens=call.max_new_tokens,
            presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty, logprobs=s.logprobs,
            logit_bias=dict(s.logit_bias) or None,
            min_tokens=s.min_new_tokens, stop_token_ids=list(call.stop_token_ids), stop=list(call.stop) or None,
            ignore_eos=True, skip_special_tokens=True, output_kind=RequestOutputKind.DELTA,
            # compact JSON, as the native thinker's grammar (omni_serve.engines.constraints) writes it (the engine's
            # structured_outputs_config says so too: vLLM's guidance backend reads it there)
            structured_outputs=StructuredOutputsParams(json=s.json_schema, disable_any_whitespace=True)
            if s.json_schema else StructuredOutputsParams(grammar=s.grammar) if s.grammar else None,
            extra_args={TAP_KEY: True} if call.talker is not None else None)

    async def run(self, engine, call: ThinkerCall) -> AsyncIterator:
        rid = call.request_id
        # A forced reply (speech) is fed as part of the prompt: its rows' states are tapped like generated ones.
        forced = list(call.forced_reply or [])
        expected = list(call.input_ids) + forced[:-1]
        prompt: dict = {"prompt_token_ids": collapse_placeholders(call.input_ids, self.model.media_token_ids)
                        + forced[:-1]}
        if call.expects_media:
            prompt["multi_modal_data"] = vllm_media(await self.io.read_one("ingress_thinker", rid))
        await engine.start()
        talker = writer = None
        if call.talker is not None:
            edge = self.spec.edge_spec(TALKER_EDGE)
            talker = TalkerStream(self.model, call, engine.tap_rows(rid), edge.chunk_size, edge.first_chunk_size,
                                  self.spec.data_timeout())
            writer = self.io.writer(TALKER_EDGE, rid)
        generated: list[int] = []
        checked = False
        async for out in engine.generate(rid, VllmRequest(prompt, self.sampling_params(call))):
            if not checked:
                if list(out.prompt_token_ids or []) != expected:
                    raise ValueError(f"vLLM expanded the prompt to {len(out.prompt_token_ids or [])} tokens, the "
                                     f"ingress to {len(expected)}: their media preprocessing differs")
                checked = True
            if forced:  # the one drawn token is dropped; the forced rows were computed with the prompt
                if out.finished:
                    if talker is not None:
                        await writer.write(await talker.update(forced, True))
                    yield TextDelta(token_ids=forced, finish_reason="stop")  # the caller's own text: not decoded
                continue
            completion = out.outputs[0]
            finish = completion.finish_reason if out.finished else None
            if finish not in (None, "stop", "length"):
                raise RuntimeError(f"vLLM ended the request: {finish}")
            new = list(completion.token_ids)
            generated.extend(new)
            if talker is not None and generated:
                chunk = await talker.update(generated, out.finished)
                if chunk is not None:
                    await writer.write(chunk)
            if new or finish:
                yield TextDelta(token_ids=new, text=completion.text, finish_reason=finish,
                                logprobs=token_logprobs(new, completion.logprobs, call.sampling.logprobs))


def token_logprobs(tokens: list[int], positions, top: int | None) -> list[TokenLogprob] | None:
    """vLLM's per-position logprobs (``{token id: Logprob}``: the sampled token and the ``top`` best by rank) as
    one ``TokenLogprob`` per sampled token; None when the call asked for none."""
    if top is None:
        return None
    out = []
    for token, position in zip(tokens, positions, strict=True):
        best = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items()
                      if lp.rank is not None and lp.rank <= top)
        out.append(TokenLogprob(logprob=position[token].logprob, top=[(tid, lp) for _, tid, lp in best]))
    return out
