"""The Wan graph spec: the video graph's request limits, defaults and job store (``omni_serve.kits.diffusion.
video_spec``), plus the ``stages``/``edges`` sections derived from the graph declaration."""

from __future__ import annotations

from pydantic import Field

from omni_serve.families.wan.graph import GRAPH
from omni_serve.kits.diffusion.video_spec import VideoGraphSpec

WanStages = GRAPH.stages_model("WanStages")
WanEdges = GRAPH.edges_model("WanEdges")


class WanGraphSpec(VideoGraphSpec):
    checkpoint: str = Field(..., description="Local Wan 2.1 text-to-video checkpoint directory (diffusers layout).")
    model_name: str = Field("wan2.1-t2v", description="Model id served at /v1/models and accepted in requests.")
    stages: WanStages = Field(default_factory=WanStages, description="One deployment per stage.")
    edges: WanEdges = Field(default_factory=WanEdges, description="Data-plane settings per edge.")
