"""Stage runners of the Qwen3-ASR graph (hosted by ``omni_serve.deployments.stage.StageDeployment``): per request
(one audio window) a runner builds its program from the call; the declared edges carry the tensors
(``ingress_encoder``: features, ``encoder_llm``: audio embeddings)."""

from __future__ import annotations

from typing import AsyncIterator

from omni_serve.families.qwen3_asr.messages import EncodeCall, TranscribeCall
from omni_serve.families.qwen3_asr.replica import programs as P
from omni_serve.graph.runner import PreparedLayers, StageRunner


class EncoderRunner(StageRunner):
    work_unit = "mel_frames"

    def batch_compute(self):
        return self.model.encode

    async def run(self, engine, call: EncodeCall) -> AsyncIterator:
        async for out in self.drive(engine, call.request_id, P.EncodeProgram()):
            yield out


class LLMRunner(PreparedLayers, StageRunner):
    async def run(self, engine, call: TranscribeCall) -> AsyncIterator:
        program = P.TranscribeSequence(self.model, call, self.engine_spec.ar.block_size,
                                       self.stage_spec.params.stream_interval)
        async for out in self.drive(engine, call.request_id, program):
            yield out
