"""A model family's stage graph as data: its stages and edges, declared once, in data-flow order.

Contract: a family declares ``GraphDef(name, stages=(StageDef...), edges=(EdgeDef...))``, and everything that
needs the topology derives it from that one object:
- the spec's ``stages`` and ``edges`` sections (``stages_model()`` / ``edges_model()``: one field per stage and
  edge, with the declared defaults and descriptions);
- the builder (``omni_serve.deployments.builder``: one Serve deployment per stage of ``deployed(layout)``);
- each replica's data plane (``omni_serve.graph.runner.StageIO``: the connector of every edge it reads or
  writes, from ``spec.edges``) and the ingress' (``omni_serve.graph.calls.StageCalls``);
- the in-process wiring of tests and tools (``omni_serve.graph.local.LocalGraph``);
- the docs' topology (``describe()``, ``omni-serve graph``, docs/graphs.md).

An edge has one name, the same everywhere: its spec field (``edges.thinker_talker``), its part of the data-plane
keys (``<request_id>/thinker_talker/<index>``) and the ``reads``/``writes`` of the stages it joins. A stage names
its runner (replica-side code, ``module:Class``, imported only in that stage's replicas), its engine kind, its
model adapter, the message types of its call and outputs, and its spec section type. Messages are checked when
the declaration is made (``GraphDef`` raises ``TypeError``/``ValueError``): every call, output and payload is a
``Message`` whose fields are typed all the way down (no ``dict``, no ``Any`` except ``Tensor``), and in each
layout every active edge has exactly one writer and one reader.

Layouts: a family may deploy different stage sets (Qwen2.5-Omni's aggregated or prefill/decode thinker); a
stage's ``layouts`` lists where it is deployed (None: everywhere). The spec names the layout in use.
"""

from __future__ import annotations

import collections.abc
import enum
import types
import typing
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any, Literal, Mapping, Union

from pydantic import BaseModel, Field, create_model

from omni_serve.graph.messages import Message, StreamChunk, is_tensor_field
from omni_serve.graph.spec import EdgeSpec, SpecModel, StageSpec

INGRESS = "ingress"  # the writer of edges the ingress fills (request media)


class EngineKind(str, enum.Enum):
    """Which engine a stage's replicas run (``omni_serve.engines``)."""

    AR = "ar"  # AREngine: continuous batching over a paged KV cache
    BATCH = "batch"  # BatchEngine: equal-keyed work of many requests in one call
    STEP = "step"  # StepEngine: each ready request stepped once per tick


@dataclass(frozen=True, eq=False)
class EdgeDef:
    name: str
    payload: type[Message]
    description: str
    stream: bool = False  # a chunk stream (payload: StreamChunk) rather than one payload per request
    defaults: Mapping[str, Any] = field(default_factory=dict)  # EdgeSpec values that differ from EdgeSpec's
    layouts: tuple[str, ...] | None = None  # layouts that use the edge (None: every layout with its writer)


@dataclass(frozen=True, eq=False)
class StageDef:
    name: str
    description: str
    runner: str  # module:Class of the StageRunner (replica side)
    engine: EngineKind
    adapter: str  # module:Class of the model adapter the runner loads
    call: type[Message]  # what the ingress sends per request
    outputs: tuple[type[Message], ...] = ()  # what the stage streams back to the ingress
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    spec: type[StageSpec] = StageSpec  # the stage's spec section (with its params)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # spec values that differ from the section's
    layouts: tuple[str, ...] | None = None  # layouts that deploy the stage (None: every layout)
    # runners of other engine backends (``engine.backend`` -> module:Class); the default runner is 'native'
    backends: Mapping[str, str] = field(default_factory=dict)

    def runner_for(self, backend: str) -> str:
        if backend == "native":
            return self.runner
        if backend not in self.backends:
            raise ValueError(f"stage {self.name} has no {backend!r} engine backend; it runs on "
                             f"{['native', *self.backends]}")
        return self.backends[backend]


@dataclass(frozen=True)
class Link:
    """One edge as deployed in a layout: ``writer`` (a stage or ``INGRESS``) -> ``reader``."""

    writer: str
    edge: str
    reader: str


@dataclass(frozen=True, eq=False)
class GraphDef:
    name: str
    stages: tuple[StageDef, ...]
    edges: tuple[EdgeDef, ...]
    ingress_writes: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ("default",)

    def __post_init__(self) -> None:
        _check(self)

    # -- lookups ------------------------------------------------------------------------------------------
    def stage(self, name: str) -> StageDef:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"graph {self.name} has no stage {name!r}; stages: {[s.name for s in self.stages]}")

    def edge(self, name: str) -> EdgeDef:
        for e in self.edges:
            if e.name == name:
                return e
        raise KeyError(f"graph {self.name} has no edge {name!r}; edges: {[e.name for e in self.edges]}")

    def deployed(self, layout: str) -> list[StageDef]:
        """The stages a layout deploys, in data-flow order."""
        if layout not in self.layouts:
            raise ValueError(f"graph {self.name} has no layout {layout!r}; layouts: {list(self.layouts)}")
        return [s for s in self.stages if s.layouts is None or layout in s.layouts]

    def edge_in(self, edge: str, layout: str) -> bool:
        """Whether ``edge`` is used in ``layout`` (an edge's ``layouts``; None: wherever it has a writer)."""
        layouts = self.edge(edge).layouts
        return layouts is None or layout in layouts

    def links(self, layout: str) -> list[Link]:
        """Every edge active in ``layout`` with its writer and reader, in declaration order."""
        writers = {e: INGRESS for e in self.ingress_writes}
        readers = {}
        for s in self.deployed(layout):
            writers.update({e: s.name for e in s.writes})
            readers.update({e: s.name for e in s.reads})
        return [Link(writers[e.name], e.name, readers[e.name]) for e in self.edges
                if e.name in writers and self.edge_in(e.name, layout)]

    def message_types(self) -> list[type[Message]]:
        out = [e.payload for e in self.edges]
        for s in self.stages:
            out += [s.call, *s.outputs]
        return list(dict.fromkeys(out))

    # -- derived spec sections ------------------------------------------------------------------------------
    def stages_model(self, model_name: str) -> type[SpecModel]:
        """The spec's ``stages`` section: one field per stage (its section type, declared defaults)."""
        fields = {s.name: (s.spec, Field(default_factory=partial(s.spec, **s.defaults), description=s.description))
                  for s in self.stages}
        return create_model(model_name, __base__=SpecModel, __doc__=f"One deployment per stage of {self.name}.",
                            **fields)

    def edges_model(self, model_name: str) -> type[SpecModel]:
        """The spec's ``edges`` section: one ``EdgeSpec`` per edge (declared defaults)."""
        fields = {e.name: (EdgeSpec, Field(default_factory=partial(EdgeSpec, **e.defaults), description=e.description))
                  for e in self.edges}
        return create_model(model_name, __base__=SpecModel, __doc__=f"Data-plane settings per edge of {self.name}.",
                            **fields)

    # -- docs -----------------------------------------------------------------------------------------------
    def describe(self, layout: str | None = None) -> str:
        """The topology of each layout as text (``omni-serve graph``, docs/graphs.md)."""
        out = []
        for lay in [layout] if layout else self.layouts:
            indent = "  " if len(self.layouts) > 1 else ""
            if indent:
                out.append(f"layout {lay}:")
            out.append(indent + "stages: " + ", ".join(f"{s.name} ({s.engine.value})" for s in self.deployed(lay)))
            pairs = [(f"{link.writer} -> {link.reader}", self.edge(link.edge)) for link in self.links(lay)]
            width = max((len(pair) for pair, _ in pairs), default=0)
            for pair, edge in pairs:
                kind = "stream" if edge.stream else "one per request"
                out.append(f"{indent}{pair:<{width}}  edge {edge.name}: {edge.payload.__name__}, {kind}")
        return "\n".join(out)


# -- declaration checks ------------------------------------------------------------------------------------
def _check(graph: GraphDef) -> None:
    names = [s.name for s in graph.stages]
    edges = [e.name for e in graph.edges]
    for kind, values in (("stage", names), ("edge", edges)):
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            raise ValueError(f"graph {graph.name}: duplicate {kind} names {dupes}")
        bad = [v for v in values if not v.isidentifier() or v.startswith("_") or v == INGRESS]
        if bad:
            raise ValueError(f"graph {graph.name}: {kind} names must be identifiers (not '{INGRESS}'): {bad}")
    known = set(edges)
    for who, used in [(INGRESS, graph.ingress_writes)] + [(s.name, s.reads + s.writes) for s in graph.stages]:
        unknown = [e for e in used if e not in known]
        if unknown:
            raise ValueError(f"graph {graph.name}: {who} uses undeclared edges {unknown}")
    for s in graph.stages:
        if s.layouts is not None and not set(s.layouts) <= set(graph.layouts):
            raise ValueError(f"graph {graph.name}: stage {s.name} names unknown layouts {s.layouts}")
        if "native" in s.backends:
            raise ValueError(f"graph {graph.name}: stage {s.name}'s runner is its native backend")
        if not issubclass(s.spec, StageSpec):
            raise TypeError(f"graph {graph.name}: stage {s.name}'s spec must subclass StageSpec")
    active: set[str] = set()
    for layout in graph.layouts:
        writers: dict[str, list[str]] = {e: [INGRESS] for e in graph.ingress_writes}
        readers: dict[str, list[str]] = {}
        for s in graph.deployed(layout):
            for e in s.writes:
                writers.setdefault(e, []).append(s.name)
            for e in s.reads:
                readers.setdefault(e, []).append(s.name)
        for e in edges:
            if not graph.edge_in(e, layout):
                continue
            w, r = writers.get(e, []), readers.get(e, [])
            if (w or r) and (len(w) != 1 or len(r) != 1):
                raise ValueError(f"graph {graph.name}, layout {layout}: edge {e} needs one writer and one reader "
                                 f"(writers {w}, readers {r})")
            if w:
                active.add(e)
    unused = [e for e in edges if e not in active]
    if unused:
        raise ValueError(f"graph {graph.name}: edges {unused} are used in no layout")
    for e in graph.edges:
        if e.layouts is not None and not set(e.layouts) <= set(graph.layouts):
            raise ValueError(f"graph {graph.name}: edge {e.name} names unknown layouts {e.layouts}")
        if e.stream and not issubclass(e.payload, StreamChunk):
            raise TypeError(f"graph {graph.name}: streamed edge {e.name}'s payload must subclass StreamChunk")
    for message in graph.message_types():
        if not (isinstance(message, type) and issubclass(message, Message)):
            raise TypeError(f"graph {graph.name}: {message!r} is not a Message")
        problems = untyped_fields(message)
        if problems:
            raise TypeError(f"graph {graph.name}: {message.__name__} must be typed all the way down (no dict, no "
                            f"Any): {problems}")


_SCALARS = (str, int, float, bool, bytes, type(None))


def untyped_fields(model: type[BaseModel]) -> list[str]:
    """Fields of ``model`` (recursively) that could carry a string-keyed dict or an unchecked object."""
    return _model_fields(model, model.__name__, set())


def _model_fields(model: type[BaseModel], path: str, seen: set) -> list[str]:
    if model in seen:
        return []
    seen.add(model)
    out = []
    for name, info in model.model_fields.items():
        if is_tensor_field(info.metadata):
            continue
        out += _untyped(info.annotation, f"{path}.{name}", seen)
    return out


def _untyped(tp: Any, path: str, seen: set) -> list[str]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        return [] if is_tensor_field(list(args[1:])) else _untyped(args[0], path, seen)
    if tp is Any or tp is object:
        return [f"{path}: Any"]
    if origin is Literal or tp in _SCALARS:
        return []
    if origin in (Union, types.UnionType) or origin in (list, tuple, set, frozenset, collections.abc.Sequence):
        return [p for a in args if a is not Ellipsis for p in _untyped(a, path, seen)]
    if origin is not None and isinstance(origin, type) and issubclass(origin, collections.abc.Mapping):
        return [f"{path}: {tp!r}"]
    if isinstance(tp, type):
        if issubclass(tp, enum.Enum):
            return []
        if issubclass(tp, BaseModel):
            return _model_fields(tp, path, seen)
    return [f"{path}: {tp!r}"]
