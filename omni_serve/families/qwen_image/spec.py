"""The Qwen-Image graph spec: the image graph's request limits and defaults (``omni_serve.kits.diffusion.spec``),
plus the ``stages``/``edges`` sections derived from the graph declaration (overridable from Python, CLI or YAML)."""

from __future__ import annotations

from pydantic import Field

from omni_serve.families.qwen_image.graph import GRAPH
from omni_serve.kits.diffusion.spec import ImageGraphSpec

QwenImageStages = GRAPH.stages_model("QwenImageStages")
QwenImageEdges = GRAPH.edges_model("QwenImageEdges")


class QwenImageGraphSpec(ImageGraphSpec):
    checkpoint: str = Field(..., description="Local Qwen-Image checkpoint directory (diffusers layout).")
    model_name: str = Field("qwen-image", description="Model id served at /v1/models and accepted in requests.")
    stages: QwenImageStages = Field(default_factory=QwenImageStages, description="One deployment per stage.")
    edges: QwenImageEdges = Field(default_factory=QwenImageEdges, description="Data-plane settings per edge.")
