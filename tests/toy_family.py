"""A family declared outside ``omni_serve`` (declaration only), for the registry's entry-point plug-in test, with its
bench plug-in (``BENCH``: one ``echo`` mode and one flag of its own), for the bench registry's test."""

from __future__ import annotations

from pydantic import Field

from omni_serve.bench.plugins import BenchPlugin
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


def _bench_arguments(group) -> None:
    group.add_argument("--echo-words", type=int, default=3, help="words per toy request (default 3)")


def _bench_run(args) -> int:
    """Runs no server: says what it was asked, so a test sees the dispatch and the parsed flags."""
    print(f"toy bench {args.mode} of {args.graph}: {args.echo_words} words to {args.url}, c={args.concurrency}")
    return 0 if args.url else 2


BENCH = BenchPlugin(family="toy", modes={"echo": "send words, read them back"}, add_arguments=_bench_arguments,
                    run=_bench_run)
