"""Stage runners of the Qwen2.5-Omni graph (hosted by ``omni_serve.deployments.stage.StageDeployment``).

The encoder runner is the Omni kit's (``omni_serve.kits.omni.replica.runners``, named by the graph directly); the
thinker runners are the kit's on this family's thinker program (``programs.ThinkerSequence``); the talker and
code2wav runners build this family's programs (``programs.TalkerSequence``, ``code2wav.Code2WavStream``). Each
turns its call into a program, reads its input edge and writes its output edge; tensors travel through the
connector, never in handle arguments.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import AsyncIterator

import numpy as np
import torch

from omni_serve.engines.sampling import SamplingParams, is_greedy
from omni_serve.families.qwen2_5_omni.messages import AudioDelta, CodecChunk, Code2WavCall, TalkerCall
from omni_serve.families.qwen2_5_omni.replica import programs as P
from omni_serve.families.qwen2_5_omni.replica.code2wav import (
    Code2WavCompute, Code2WavRequest, Code2WavStream, check_chunking,
)
from omni_serve.graph.runner import PreparedLayers, StageRunner
from omni_serve.kits.omni.replica.chunk_plan import OpeningRates
from omni_serve.kits.omni.replica.streams import client_pace, talker_lead
from omni_serve.kits.omni.replica import runners as omni

log = logging.getLogger(__name__)


class ThinkerRunner(PreparedLayers, omni.ThinkerRunner):
    sequence = P.ThinkerSequence


class ThinkerPrefillRunner(PreparedLayers, omni.ThinkerPrefillRunner):
    sequence = P.ThinkerSequence


class ThinkerDecodeRunner(PreparedLayers, omni.ThinkerDecodeRunner):
    sequence = P.ThinkerSequence


class TalkerRunner(PreparedLayers, StageRunner):
    async def run(self, engine, call: TalkerCall) -> AsyncIterator:
        p = self.stage_spec.params
        sampling = SamplingParams(
            temperature=0.0 if is_greedy(call.temperature) else p.temperature, top_k=p.top_k, top_p=p.top_p,
            repetition_penalty=p.repetition_penalty, seed=call.seed, suppress_tokens=(self.model.codec_bos,))
        edge = self.spec.edge_spec("talker_code2wav")
        program = P.TalkerSequence(self.model, P.TalkerRequest(
            max_new_tokens=p.max_codec_tokens, sampling=sampling, chunk_size=edge.chunk_size,
            first_chunk_size=edge.first_chunk_size))
        program.lead = talker_lead(self.spec, call.paced, self.model.codes_per_s)
        async for out in self.drive(engine, call.request_id, program):
            yield out


def dit_dtype(setting: str, device: str) -> torch.dtype:
    """``stages.code2wav.params.dit_dtype`` as a torch dtype: ``auto`` is bfloat16 where this CPU runs it faster
    than float32 (``omni_kernels.bfloat16_slow_reason``), else float32; the choice is a kernel path on /health."""
    if setting != "auto":
        return getattr(torch, setting)
    from omni_kernels import bfloat16_slow_reason, record_path

    why = bfloat16_slow_reason() if device == "cpu" else f"auto is float32 on {device} (bfloat16 not measured there)"
    record_path("code2wav.dit_dtype", "float32" if why else "bfloat16", why)
    return torch.float32 if why else torch.bfloat16


class Code2WavRunner(StageRunner):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_chunking(self.model, self._request("", 0))
        self.openings = OpeningRates()  # the rate codes came at in this replica's recent streams' openings

    def adapter_options(self):
        p = self.stage_spec.params
        return {"dit_dtype": dit_dtype(p.dit_dtype, self.engine_spec.device), "prepared_dit": p.prepared_dit,
                "prepared_vocoder": p.prepared_vocoder}

    def _request(self, voice: str, seed: int) -> Code2WavRequest:
        p = self.stage_spec.params
        return Code2WavRequest(
            voice=voice, seed=seed, num_steps=p.num_steps, guidance_scale=p.guidance_scale,
            sway_coefficient=p.sway_coefficient, first_chunk_codes=p.first_chunk_codes, chunk_codes=p.chunk_codes,
            chunk_growth=p.chunk_growth, cut_lead_s=p.cut_lead_s, plan_margin=p.plan_margin,
            left_context_codes=p.left_context_codes, right_context_codes=p.right_context_codes,
            vocoder_context_frames=p.vocoder_context_frames)

    def batch_compute(self):
        p = self.stage_spec.params
        return Code2WavCompute(self.model, p.num_steps, p.guidance_scale, p.sway_coefficient)

    def make_engine(self):
        engine = super().make_engine()
        if self.stage_spec.params.plan_chunks and getattr(engine, "cost", None) is not None:
            self._time_calls(engine)
        return engine

    def _time_calls(self, engine) -> None:
        """Seed the engine's cost model with a first-chunk call and a full-chunk call (each timed after an untimed
        one), so that the replica's first streams get planned chunks too. On the small checkpoint and 2 cores this
        takes a few seconds of start-up."""
        if engine.torch_threads:
            torch.set_num_threads(engine.torch_threads)
        voice, p = next(iter(self.model.speakers)), self.stage_spec.params
        with torch.inference_mode():
            for codes in (p.first_chunk_codes, p.chunk_codes):
                for timed in (False, True):
                    stream = Code2WavStream(self.model, replace(self._request(voice, 0), first_chunk_codes=codes))
                    stream.feed(CodecChunk(codes=[0] * (codes + p.right_context_codes), end=True))
                    size = stream.work_size()
                    _, job = stream.work()
                    start = time.perf_counter()
                    engine.compute([job])
                    if timed:
                        engine.cost.add(size, time.perf_counter() - start)
        log.info("code2wav: call cost seeded: %s (fixed s, s per mel frame)", engine.cost.coefficients())

    async def run(self, engine, call: Code2WavCall) -> AsyncIterator:
        if call.voice not in self.model.speakers:
            raise ValueError(f"unknown voice {call.voice!r}")
        p = self.stage_spec.params
        program = Code2WavStream(self.model, self._request(call.voice, call.seed))
        program.pace = client_pace(self.spec)  # its chunks are due when its client needs them
        if p.plan_chunks and getattr(engine, "cost", None) is not None:
            # ... and as long as this machine's calls allow; a paced talker's codes come at its pace, not at what
            # it can do, so paced graphs neither count nor use the openings' rates
            program.plan_with(engine.cost, None if self.spec.playback.talker_lead_s else self.openings)
        async for out in self.drive(engine, call.request_id, program):
            # Audio for the client is the response payload itself (bytes), not a data-plane reference.
            yield AudioDelta(samples=np.asarray(out.audio, dtype="<f4").tobytes(), num_codes=out.num_codes)
