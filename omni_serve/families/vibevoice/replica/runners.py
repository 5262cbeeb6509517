"""The VibeVoice graph's stage runner (hosted by ``omni_serve.deployments.stage.StageDeployment``): per request, a
``SpeakSequence`` from the call, fed the speakers' clips from ``ingress_lm``."""

from __future__ import annotations

from typing import AsyncIterator

from omni_serve.families.vibevoice.messages import SpeakCall
from omni_serve.families.vibevoice.replica import programs as P
from omni_serve.graph.runner import PreparedLayers, StageRunner


class LMRunner(PreparedLayers, StageRunner):
    def adapter_options(self):
        ar = self.engine_spec.ar
        return {**super().adapter_options(), "branch_block_size": ar.block_size,
                "branch_kv_blocks": max(2, round(ar.num_kv_blocks * self.stage_spec.params.branch_kv_factor))}

    async def run(self, engine, call: SpeakCall) -> AsyncIterator:
        async for out in self.drive(engine, call.request_id, P.SpeakSequence(self.model, call)):
            yield out
