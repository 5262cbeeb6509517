"""Per-stage settings of the GLM-Image graph (the ``params`` of each stage's spec section). The AR stage's engine
settings (KV cache, batch) are its ``engine.ar``; the text encoder's are the diffusion kit's."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.kits.diffusion.params import TextEncoderStage  # noqa: F401 - the glyph encoder's section
from omni_serve.graph.spec import StageSpec


class ARParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    greedy: bool = Field(False, description=(
        "Pick every visual token greedily instead of sampling with the checkpoint's generation config and the "
        "request's seed (the pipeline samples; greedy is for checks against generate(do_sample=False))."))


class DiTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(8, ge=1, description=(
        "Requests whose step shares the transformer (CFG adds a row per image; one forward per glyph length)."))


class VAEParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(8, ge=1, description="Same-size requests decoded in one VAE call.")


class ARStage(StageSpec):
    params: ARParams = Field(default_factory=ARParams, description="AR (visual token) settings.")


class DiTStage(StageSpec):
    params: DiTParams = Field(default_factory=DiTParams, description="Denoising loop settings.")

    parallel_kinds = ("rows",)  # a step's rows split across the replica's ranks (omni_serve.graph.ranks)


class VAEStage(StageSpec):
    params: VAEParams = Field(default_factory=VAEParams, description="VAE decoder settings.")
