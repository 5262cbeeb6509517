"""The toy graph: encode -> decode over one edge."""

from __future__ import annotations

from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef
from tests.toy_family.messages import EchoCall, Echoed, Features

RUNNERS = "tests.toy_family.replica.runners"
ADAPTER = "tests.toy_family.model:ToyModel"

GRAPH = GraphDef(
    name="toy",
    stages=(
        StageDef("encode", "Text -> features.", f"{RUNNERS}:EncodeRunner", EngineKind.STEP, ADAPTER, call=EchoCall,
                 writes=("encode_decode",), defaults={"num_cpus": 0.1}),
        StageDef("decode", "Features -> text.", f"{RUNNERS}:DecodeRunner", EngineKind.STEP, ADAPTER, call=EchoCall,
                 outputs=(Echoed,), reads=("encode_decode",), defaults={"num_cpus": 0.1}),
    ),
    edges=(EdgeDef("encode_decode", Features, "Features to the decoder."),),
)
