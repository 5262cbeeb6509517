"""Per-stage settings of the VibeVoice graph. The lm stage's engine settings (KV cache, batch) are its
``engine.ar``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.graph.spec import StageSpec


class LMParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    branch_kv_factor: float = Field(2.0, ge=0.1, description=(
        "KV blocks of the side branches (the negative branch and the token CFG pass) as a multiple of "
        "engine.ar.num_kv_blocks: at 2 they never run short; below, requests outside a step may lose theirs "
        "(recomputed when they next run)."))


class LMStage(StageSpec):
    params: LMParams = Field(default_factory=LMParams, description="LM settings.")
