"""Stage runners of the Qwen2.5-Omni graph (hosted by ``omni_serve.deployments.stage.StageDeployment``).

Each runner runs on the engine and adapter its declaration names (``graph.GRAPH``) and, per request, builds the
program from the stage's call (plain ids and settings, no tensors), reads its input edge and writes its output
edge. In the disaggregated thinker layout the thinker is two stages: ``ThinkerPrefillRunner`` (reads
``encoder_thinker``, writes the prompt hand-off on ``thinker_prefill_thinker_decode``) and
``ThinkerDecodeRunner`` (reads that hand-off, writes ``thinker_talker`` and yields the text).
"""

from __future__ import annotations

from typing import AsyncIterator

import numpy as np
import torch

from omni_serve.engines.sampling import SamplingParams, is_greedy
from omni_serve.families.qwen2_5_omni.messages import (
    AudioDelta, Code2WavCall, EncoderCall, PrefillDone, TalkerCall, ThinkerCall,
)
from omni_serve.families.qwen2_5_omni.replica import programs as P
from omni_serve.families.qwen2_5_omni.replica.code2wav import Code2WavCompute, Code2WavRequest, Code2WavStream, check_chunking
from omni_serve.graph.runner import StageRunner

HANDOFF = "thinker_prefill_thinker_decode"


class EncoderRunner(StageRunner):
    async def run(self, engine, call: EncoderCall) -> AsyncIterator:
        program = P.EncoderProgram(self.model)
        async for out in self.drive(engine, call.request_id, program, reads="ingress_encoder",
                                    writes="encoder_thinker"):
            yield out


class ThinkerRunner(StageRunner):
    """The thinker in the aggregated layout; its subclasses are the two halves of the disaggregated one."""

    role = P.ThinkerRole.AGGREGATED
    sequence = P.ThinkerSequence  # the program (Qwen3-Omni's runners name their own)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.checkpoint)
        self.media_token_ids = self.model.media_token_ids

    def thinker_request(self, call: ThinkerCall) -> P.ThinkerRequest:
        edge, s = self.spec.edge_spec("thinker_talker"), call.sampling
        stops = tuple(call.stop_token_ids)
        talker = call.talker
        return P.ThinkerRequest(
            input_ids=call.input_ids, max_new_tokens=call.max_new_tokens,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, seed=s.seed,
                                    min_new_tokens=s.min_new_tokens, stop_token_ids=stops),
            stop_token_ids=stops, stop=tuple(call.stop), media_layout=call.media_layout,
            expects_media=call.expects_media,
            talker_voice_token=None if talker is None else talker.voice_token,
            talker_tokens=(0, 0) if talker is None else (talker.tts_end_token, talker.tts_pad_token),
            chunk_size=edge.chunk_size, first_chunk_size=edge.first_chunk_size,
            media_token_ids=self.media_token_ids, block_size=self.engine_spec.ar.block_size,
            forced_reply=tuple(call.forced_reply or ()),
        )

    async def run(self, engine, call: ThinkerCall) -> AsyncIterator:
        req = self.thinker_request(call)
        program = self.sequence(self.model, self.tokenizer, req, role=self.role)
        rid = call.request_id
        if self.role is P.ThinkerRole.DECODE:
            program.feed(await self.io.read_one(HANDOFF, rid))
        elif req.expects_media:
            program.feed(await self.io.read_one("encoder_thinker", rid))
        if self.role is P.ThinkerRole.PREFILL:
            writes = HANDOFF
        else:
            writes = "thinker_talker" if call.talker is not None else None
        async for out in self.drive(engine, rid, program, writes=writes):
            yield out
        if self.role is P.ThinkerRole.PREFILL:
            yield PrefillDone(prompt_tokens=program.prompt_len)


class ThinkerPrefillRunner(ThinkerRunner):
    """Disaggregated layout, first half: the prompt's KV, handed to ``thinker_decode``."""

    role = P.ThinkerRole.PREFILL


class ThinkerDecodeRunner(ThinkerRunner):
    """Disaggregated layout, second half: adopts the prefilled prompt and generates."""

    role = P.ThinkerRole.DECODE


class TalkerRunner(StageRunner):
    async def run(self, engine, call: TalkerCall) -> AsyncIterator:
        p = self.stage_spec.params
        sampling = SamplingParams(
            temperature=0.0 if is_greedy(call.temperature) else p.temperature, top_k=p.top_k, top_p=p.top_p,
            repetition_penalty=p.repetition_penalty, seed=call.seed, suppress_tokens=(self.model.codec_bos,))
        edge = self.spec.edge_spec("talker_code2wav")
        program = P.TalkerSequence(self.model, P.TalkerRequest(
            max_new_tokens=p.max_codec_tokens, sampling=sampling, chunk_size=edge.chunk_size,
            first_chunk_size=edge.first_chunk_size))
        async for out in self.drive(engine, call.request_id, program, reads="thinker_talker",
                                    writes="talker_code2wav"):
            yield out


class Code2WavRunner(StageRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_chunking(self.model, self._request("", 0))

    def adapter_options(self):
        return {"dit_dtype": getattr(torch, self.stage_spec.params.dit_dtype)}

    def _request(self, voice: str, seed: int) -> Code2WavRequest:
        p = self.stage_spec.params
        return Code2WavRequest(
            voice=voice, seed=seed, num_steps=p.num_steps, guidance_scale=p.guidance_scale,
            sway_coefficient=p.sway_coefficient, first_chunk_codes=p.first_chunk_codes, chunk_codes=p.chunk_codes,
            left_context_codes=p.left_context_codes, right_context_codes=p.right_context_codes,
            vocoder_context_frames=p.vocoder_context_frames)

    def batch_compute(self):
        p = self.stage_spec.params
        return Code2WavCompute(self.model, p.num_steps, p.guidance_scale, p.sway_coefficient)

    async def run(self, engine, call: Code2WavCall) -> AsyncIterator:
        if call.voice not in self.model.speakers:
            raise ValueError(f"unknown voice {call.voice!r}")
        program = Code2WavStream(self.model, self._request(call.voice, call.seed))
        async for out in self.drive(engine, call.request_id, program, reads="talker_code2wav"):
            # Audio for the client is the response payload itself (bytes), not a data-plane reference.
            yield AudioDelta(samples=np.asarray(out.audio, dtype="<f4").tobytes(), num_codes=out.num_codes)
