"""Stage runners of the Qwen3-Omni graph (hosted by ``omni_serve.deployments.stage.StageDeployment``).

The encoder runner is the Omni kit's (``omni_serve.kits.omni.replica.runners``, named by the graph directly) and
the thinker runners the kit's on Qwen3-Omni's adapters and thinker program; the talker and code2wav runners build Qwen3-Omni's programs
(``programs.py``, ``code2wav.py``). Each turns its call into a program, reads its input edge and writes its
output edge; tensors travel through the connector, never in handle arguments.
"""

from __future__ import annotations

from typing import AsyncIterator

import numpy as np

from omni_serve.engines.sampling import SamplingParams, is_greedy
from omni_serve.families.qwen3_omni.messages import AudioDelta, Code2WavCall, TalkerCall
from omni_serve.families.qwen3_omni.replica.code2wav import Code2WavCompute, Code2WavRequest, Code2WavStream
from omni_serve.families.qwen3_omni.replica.programs import Qwen3TalkerSequence, Qwen3ThinkerSequence, TalkerRequest
from omni_serve.graph.runner import StageRunner
from omni_serve.kits.omni.replica.streams import client_pace, talker_lead
from omni_serve.kits.omni.replica import runners as omni

class ThinkerRunner(omni.ThinkerRunner):
    sequence = Qwen3ThinkerSequence


class ThinkerPrefillRunner(omni.ThinkerPrefillRunner):
    sequence = Qwen3ThinkerSequence


class ThinkerDecodeRunner(omni.ThinkerDecodeRunner):
    sequence = Qwen3ThinkerSequence


class TalkerRunner(StageRunner):
    async def run(self, engine, call: TalkerCall) -> AsyncIterator:
        voices = self.model.voices
        if call.voice not in voices:
            raise ValueError(f"unknown voice {call.voice!r}; the checkpoint has {sorted(voices)}")
        p, greedy = self.stage_spec.params, is_greedy(call.temperature)
        sampling = SamplingParams(
            temperature=0.0 if greedy else p.temperature, top_k=p.top_k, top_p=p.top_p,
            repetition_penalty=p.repetition_penalty, seed=call.seed, suppress_tokens=self.model.suppress_tokens)
        predictor = SamplingParams(temperature=0.0 if greedy else 1.0, top_k=p.predictor_top_k,
                                   top_p=p.predictor_top_p, seed=call.seed + 1)
        edge = self.spec.edge_spec("talker_code2wav")
        program = Qwen3TalkerSequence(self.model, TalkerRequest(
            voice_id=voices[call.voice], max_new_tokens=p.max_codec_tokens, sampling=sampling,
            predictor_sampling=predictor, chunk_size=edge.chunk_size, first_chunk_size=edge.first_chunk_size,
            media_layout=call.media_layout, return_frames=call.return_frames))
        program.lead = talker_lead(self.spec, call.paced, self.model.codes_per_s)
        async for out in self.drive(engine, call.request_id, program):
            yield out


class Code2WavRunner(StageRunner):
    def batch_compute(self):
        return Code2WavCompute(self.model)

    async def run(self, engine, call: Code2WavCall) -> AsyncIterator:
        p = self.stage_spec.params
        program = Code2WavStream(self.model, Code2WavRequest(
            first_chunk_codes=p.first_chunk_codes, chunk_codes=p.chunk_codes, block_codes=p.block_codes,
            block_left_context=p.block_left_context, cut_lead_s=p.cut_lead_s))
        program.pace = client_pace(self.spec)  # its chunks are due when its client needs them
        async for out in self.drive(engine, call.request_id, program):
            # Audio for the client is the response payload itself (bytes), not a data-plane reference.
            yield AudioDelta(samples=np.asarray(out.audio, dtype="<f4").tobytes(), num_codes=out.num_codes)
