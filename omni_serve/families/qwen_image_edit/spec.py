"""The Qwen-Image-Edit graph spec: the image graph's request limits and defaults (``omni_serve.kits.diffusion``),
the input image's limits, and the ``stages``/``edges`` sections derived from the graph declaration (overridable from Python, CLI or YAML).

``default_size`` may be ``auto`` (the default): an edit without ``size`` comes out at the input image's
conditioning size, the input's aspect ratio at ~1 MP in multiples of 32, as diffusers' pipeline does.
"""

from __future__ import annotations

from pydantic import Field

from omni_serve.families.qwen_image_edit.graph import GRAPH
from omni_serve.kits.diffusion.spec import ImageGraphSpec

QwenImageEditStages = GRAPH.stages_model("QwenImageEditStages")
QwenImageEditEdges = GRAPH.edges_model("QwenImageEditEdges")


class QwenImageEditGraphSpec(ImageGraphSpec):
    size_words = ("auto",)

    checkpoint: str = Field(..., description="Local Qwen-Image-Edit checkpoint directory (diffusers layout).")
    model_name: str = Field("qwen-image-edit", description="Model id served at /v1/models and accepted in requests.")
    default_size: str = Field("auto", description=(
        "Output size when a request gives none: 'auto' (the input image's conditioning size: its aspect ratio at "
        "~1 MP, as diffusers' pipeline) or 'WIDTHxHEIGHT'."))
    max_input_pixels: int = Field(4096 * 4096, ge=256, description="Largest input image (or mask) accepted, pixels.")
    max_input_bytes: int = Field(32 << 20, ge=1024, description="Largest uploaded image (or mask) file, bytes.")
    stages: QwenImageEditStages = Field(default_factory=QwenImageEditStages, description="One deployment per stage.")
    edges: QwenImageEditEdges = Field(default_factory=QwenImageEditEdges, description="Data-plane settings per edge.")
