"""The Wan image-to-video graph spec: the video graph's request limits, defaults and job store
(``omni_serve.kits.diffusion.video_spec``), the reference image's limits, and the ``stages``/``edges`` sections
derived from the graph declaration."""

from __future__ import annotations

from pydantic import Field

from omni_serve.families.wan_i2v.graph import GRAPH
from omni_serve.kits.diffusion.video_spec import VideoGraphSpec

WanImageToVideoStages = GRAPH.stages_model("WanImageToVideoStages")
WanImageToVideoEdges = GRAPH.edges_model("WanImageToVideoEdges")


class WanImageToVideoGraphSpec(VideoGraphSpec):
    checkpoint: str = Field(..., description=(
        "Local Wan 2.1 image-to-video checkpoint directory (diffusers layout, with image_encoder/)."))
    model_name: str = Field("wan2.1-i2v", description="Model id served at /v1/models and accepted in requests.")
    max_input_bytes: int = Field(32 << 20, ge=1024, description="Largest uploaded reference image file, bytes.")
    stages: WanImageToVideoStages = Field(default_factory=WanImageToVideoStages,
                                          description="One deployment per stage.")
    edges: WanImageToVideoEdges = Field(default_factory=WanImageToVideoEdges,
                                        description="Data-plane settings per edge.")
