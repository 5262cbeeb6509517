"""The toy graph spec: the served model id and the sections derived from the graph declaration."""

from __future__ import annotations

from pydantic import Field

from omni_serve.graph.spec import GraphSpecBase
from tests.toy_family.graph import GRAPH

ToyStages, ToyEdges = GRAPH.stages_model("ToyStages"), GRAPH.edges_model("ToyEdges")


class ToySpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Toy checkpoint directory (toy.json + embedding.pt).")
    model_name: str = Field("toy", description="Served model id.")
    max_chars: int = Field(256, ge=1, description="Longest text echoed.")
    stages: ToyStages = Field(default_factory=ToyStages, description="Stages.")
    edges: ToyEdges = Field(default_factory=ToyEdges, description="Edges.")
