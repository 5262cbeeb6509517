"""The GLM-Image graph spec: request limits and defaults (the pipeline's: 50 steps, guidance 1.5), plus the
``stages``/``edges`` sections derived from the graph declaration (overridable from Python, CLI or YAML)."""

from __future__ import annotations

from pydantic import Field, model_validator

from omni_serve.families.glm_image.graph import GRAPH
from omni_serve.families.glm_image.params import (  # noqa: F401 - the spec's section types, importable from here
    ARParams, ARStage, DiTParams, DiTStage, TextEncoderStage, VAEParams, VAEStage,
)
from omni_serve.kits.diffusion.spec import size_dimensions
from omni_serve.graph.spec import GraphSpecBase

GlmImageStages = GRAPH.stages_model("GlmImageStages")
GlmImageEdges = GRAPH.edges_model("GlmImageEdges")


class GlmImageGraphSpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Local GLM-Image checkpoint directory (diffusers layout).")
    model_name: str = Field("glm-image", description="Model id served at /v1/models and accepted in requests.")
    default_size: str = Field("256x256", description=(
        "Image size when a request gives none ('WIDTHxHEIGHT'; multiples of 32, the AR model's grid)."))
    max_side: int = Field(2048, ge=32, description="Largest width or height accepted (pixels).")
    max_pixels: int = Field(2048 * 2048, ge=1024, description="Largest width x height accepted.")
    max_images: int = Field(4, ge=1, le=16, description="Most images per request (n; one AR pass serves them all).")
    default_steps: int = Field(50, ge=1, description="Denoising steps when a request gives none (the pipeline's).")
    max_steps: int = Field(100, ge=1, description="Most denoising steps a request may ask for.")
    default_guidance_scale: float = Field(1.5, ge=0, description=(
        "CFG scale when a request gives none (the pipeline's); CFG runs when > 1, with the visual tokens dropped "
        "and the glyphs of \"\" in the unconditional branch."))
    stages: GlmImageStages = Field(default_factory=GlmImageStages, description="One deployment per stage.")
    edges: GlmImageEdges = Field(default_factory=GlmImageEdges, description="Data-plane settings per edge.")

    @model_validator(mode="after")
    def _check(self) -> "GlmImageGraphSpec":
        if self.default_steps > self.max_steps:
            raise ValueError("default_steps must be <= max_steps")
        if self.default_dimensions() is None:
            raise ValueError("default_size must be 'WIDTHxHEIGHT'")
        return self

    def default_dimensions(self) -> tuple[int, int] | None:
        """(width, height) of ``default_size``, None if it is not 'WIDTHxHEIGHT'."""
        return size_dimensions(self.default_size)
