"""A family declared outside ``omni_serve`` (declaration only), for the registry's entry-point plug-in test."""

from __future__ import annotations

from pydantic import Field

from omni_serve.graph.family import Family
from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from omni_serve.graph.messages import Message, Tensor
from omni_serve.graph.spec import GraphSpecBase


class EchoCall(Message):
    request_id: str


class Echoed(Message):
    text: str


class Features(Message):
    values: Tensor


GRAPH = GraphDef(
    name="toy",
    stages=(
        StageDef("encode", "Text -> features.", "tests.toy_family:EncodeRunner", EngineKind.STEP,
                 "tests.toy_family:Adapter", call=EchoCall, writes=("encode_decode",)),
        StageDef("decode", "Features -> text.", "tests.toy_family:DecodeRunner", EngineKind.STEP,
                 "tests.toy_family:Adapter", call=EchoCall, outputs=(Echoed,), reads=("encode_decode",)),
    ),
    edges=(EdgeDef("encode_decode", Features, "Features to the decoder."),),
)


ToyStages, ToyEdges = GRAPH.stages_model("ToyStages"), GRAPH.edges_model("ToyEdges")


class ToySpec(GraphSpecBase):
    model_name: str = Field("toy", description="Served model id.")
    stages: ToyStages = Field(default_factory=ToyStages, description="Stages.")
    edges: ToyEdges = Field(default_factory=ToyEdges, description="Edges.")


FAMILY = Family(name="toy", module=__name__, description="A toy plug-in.", graph=GRAPH, spec=ToySpec,
                frontend="tests.toy_family:ToyFrontend", checkpoint_marker="config.json")
