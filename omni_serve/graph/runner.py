"""Replica-side code of one stage: load its model, make its engine, run one request per call, typed.

Contract: a family's stage runner subclasses ``StageRunner`` and implements ``run(engine, call)``: turn the
call (the stage's declared call message) into a program, pump its input edge into the program and its outputs
to its output edge (``drive``), and yield the outputs meant for the ingress. ``build_runner(family, stage, spec)``
builds the runner the declaration names; it loads the stage's model adapter (``load()``; override
``adapter_options()`` for extra arguments) and ``make_engine()`` builds the engine of the stage's ``engine_kind()``
through ``omni_serve.engines.registry`` (the declared ``EngineKind``, or the ``engine.backend`` when it is not
native; batch stages provide ``batch_compute()``, ``engine_options()`` adds constructor arguments; the
``PreparedLayers`` mixin passes ``engine.ar.prepared_layers`` to a decoder adapter). Runners hold no per-request
state; programs do.

``handle(engine, call)`` is the checked entry point the hosts use (the Serve deployment, ``LocalGraph``): the
call must be an instance of the stage's call type (re-validated, since it crossed a process boundary) and
every output one of the stage's declared output types; anything else fails the request with ``TypeError``.

``StageIO`` is a stage's view of the data plane: the connector of each edge it reads or writes (the spec's
``edges.<edge>.connector``, or one connector for all, e.g. in tests), payloads checked against the edge's
declared type on both sides. ``handle`` first tells the connectors of the edges the stage reads that it will read
the request's streams (``Connector.expect``); a host whose call failed or was cancelled calls
``StageIO.free_request`` to drop what the request left on this stage's connectors.
"""

from __future__ import annotations

import abc
import logging
from typing import Any, AsyncIterator

from omni_serve.engines.base import Engine, StageProgram
from omni_serve.engines.registry import make_engine
from omni_serve.graph.family import Family
from omni_serve.graph.graph import EdgeDef, GraphDef, StageDef
from omni_serve.graph.messages import Message
from omni_serve.graph.registry import import_path
from omni_serve.transport.base import ChunkWriter, Connector, chunk_key, observed_get, read_chunks
from omni_serve.transport.connectors import get_connector

log = logging.getLogger(__name__)

DECLARED = object()  # ``StageRunner.drive``'s default: the edges the stage declares


class StageIO:
    def __init__(self, graph: GraphDef, stage: StageDef, spec: Any, connector: Connector | None = None):
        self.graph, self.stage, self.spec = graph, stage, spec
        self.timeout_s = spec.data_timeout()
        self._connector = connector

    def connector(self, edge: str) -> Connector:
        if self._connector is not None:
            return self._connector
        return get_connector(self.spec.edge_spec(edge).connector, self.spec.data_plane)

    def _edge(self, edge: str, direction: str) -> EdgeDef:
        if edge not in getattr(self.stage, direction):
            raise ValueError(f"stage {self.stage.name} does not {direction[:-1]} edge {edge!r}")
        return self.graph.edge(edge)

    def _checked(self, edge: EdgeDef, payload: Any) -> Message:
        if not isinstance(payload, edge.payload):
            raise TypeError(f"edge {edge.name} carries {edge.payload.__name__}, not {type(payload).__name__}")
        return edge.payload.model_validate(payload)

    async def read_one(self, edge: str, request_id: str) -> Message:
        """The single payload of a request on ``edge`` (freed once read)."""
        e = self._edge(edge, "reads")
        conn, key = self.connector(edge), chunk_key(request_id, edge, 0)
        payload = await observed_get(conn, key, self.timeout_s)
        await conn.free(key)
        return self._checked(e, payload)

    async def stream(self, edge: str, request_id: str) -> AsyncIterator[Message]:
        """A request's chunks on ``edge`` in order, until the last (a one-payload edge: that payload)."""
        e = self._edge(edge, "reads")
        if not e.stream:
            yield await self.read_one(edge, request_id)
            return
        async for payload in read_chunks(self.connector(edge), request_id, edge, self.timeout_s):
            yield self._checked(e, payload)

    async def streams(self, edges: tuple[str, ...], request_id: str) -> AsyncIterator[Message]:
        """``stream`` of each edge in turn."""
        for edge in edges:
            async for payload in self.stream(edge, request_id):
                yield payload

    def writer(self, edge: str, request_id: str) -> "EdgeWriter":
        return EdgeWriter(self._edge(edge, "writes"), self.connector(edge), request_id)

    def expect(self, request_id: str) -> None:
        """Tell the connectors of the edges this stage reads that this process will read the request's streams
        (a call just started): a connector that routes by the consumer's node learns it before the first put."""
        for edge in self.stage.reads:
            self.connector(edge).expect(request_id, edge)

    async def free_request(self, request_id: str) -> None:
        """Drop what the request left on this stage's connectors (its call failed or was cancelled): this node's
        shared memory, and what the directory still lists of it."""
        edges = (*self.stage.reads, *self.stage.writes)
        for connector in {id(c): c for c in map(self.connector, edges)}.values():
            try:
                await connector.free_request(request_id)
            except Exception:  # noqa: BLE001 - the producers' TTL sweeps are the backstop
                log.exception("request %s: freeing %s data-plane payloads failed", request_id, connector.name)


class EdgeWriter:
    """Writes one request's payloads on one edge (one payload, or a chunk stream)."""

    def __init__(self, edge: EdgeDef, connector: Connector, request_id: str):
        self.edge = edge
        self._chunks = ChunkWriter(connector, request_id, edge.name)

    def accepts(self, item: Any) -> bool:
        return isinstance(item, self.edge.payload)

    async def write(self, payload: Message) -> None:
        if not self.accepts(payload):
            raise TypeError(f"edge {self.edge.name} carries {self.edge.payload.__name__}, not {type(payload).__name__}")
        if not self.edge.stream and self._chunks.index:
            raise RuntimeError(f"edge {self.edge.name} carries one payload per request")
        await self._chunks.write(payload)


class StageRunner(abc.ABC):
    def __init__(self, graph: GraphDef, stage: StageDef, spec: Any, io: StageIO | None = None):
        self.graph, self.stage, self.spec = graph, stage, spec
        self.stage_spec = spec.stage_spec(stage.name)
        self.engine_spec = self.stage_spec.engine
        self.io = io or StageIO(graph, stage, spec)
        self.family_path: str | None = None  # the family's import path (build_runner sets it)
        self.ranked = None  # the replica's rank workers (omni_serve.graph.ranks.RankedStage), when it has any
        self.model = self.load()

    # -- what a family overrides ------------------------------------------------------------------------
    def adapter_options(self) -> dict[str, Any]:
        """Extra keyword arguments of the stage's adapter (besides checkpoint, dtype, device)."""
        return {}

    def load(self):
        """The stage's model: its declared adapter on the checkpoint."""
        e = self.engine_spec
        return import_path(self.stage.adapter)(self.spec.checkpoint, dtype=e.torch_dtype(), device=e.device,
                                               **self.adapter_options())

    def batch_compute(self):
        """Batch stages: the engine's ``compute(payloads) -> results``."""
        raise NotImplementedError(f"stage {self.stage.name} declares a batch engine but no batch_compute()")

    def max_batch(self) -> int:
        """Batch stages: payloads per compute call (the stage's ``params.max_batch``)."""
        return self.stage_spec.params.max_batch

    work_unit: str | None = None  # batch stages: what programs' work_left() counts (load reporting)

    def engine_options(self) -> dict[str, Any]:
        """Extra keyword arguments of the stage's engine (kind-specific, e.g. vLLM's ``max_model_len``)."""
        return {}

    @abc.abstractmethod
    def run(self, engine: Engine, call: Message) -> AsyncIterator[Message]: ...

    # -- generic ------------------------------------------------------------------------------------------
    def modules(self) -> dict[str, Any]:
        return self.model.modules

    def engine_kind(self) -> str:
        """The registry kind of the stage's engine: the declared ``EngineKind`` on the native backend, else the
        backend's name (``vllm``)."""
        backend = self.engine_spec.backend
        return self.stage.engine.value if backend == "native" else backend

    def make_engine(self) -> Engine:
        """The stage's engine; a stage with extra ranks (``parallel``) starts its rank workers first (with
        ``parallel.tensor``, ``parallel.expert`` or ``parallel.sequence``, the replica's model becomes rank 0 of their
        group)."""
        p = self.stage_spec.parallel
        if p.ranks > 1 and self.ranked is None:
            from omni_serve.graph.ranks import RankedStage, ShardedModel, check_model_split, shard_model

            if p.sharded:  # a split the model does not allow fails before any rank loads
                check_model_split(self.model, p.sharded, p.ranks)
            if p.sequence > 1:
                self.model.check_sequence_split()
            self.ranked = RankedStage.start(self)
            try:
                if p.sharded:  # the replica is rank 0 of the group
                    shard_model(self.model, p.sharded, 0, p.ranks)
                    self.model = ShardedModel(self.model, self.ranked)
                if p.sequence > 1:
                    self.model.shard_sequence()
                    self.ranked.shards = self.model.packed.shards
            except BaseException:
                self.close()
                raise
        try:
            return make_engine(self.engine_kind(), self)
        except BaseException:
            self.close()  # the rank workers, if any
            raise

    def split_rows(self, compute):
        """``compute`` (a batched computation over works with ``rows``) with its rows split across the replica's
        ranks when the stage has extra ranks (``omni_serve.graph.ranks``); as is otherwise."""
        if self.ranked is None:
            return compute
        from omni_serve.graph.ranks import RowSplitCompute, SequenceSplitCompute

        if self.stage_spec.parallel.sequence > 1:  # every rank computes every row, a share of its tokens each
            return SequenceSplitCompute(compute, self.ranked)
        return RowSplitCompute(compute, self.ranked)

    def check_health(self) -> None:
        """Raises when the replica cannot serve: a rank worker was lost."""
        if self.ranked is not None and not self.ranked.check():
            raise RuntimeError(f"stage {self.stage.name}: a rank worker of this replica was lost")

    def close(self) -> None:
        """Stop what the runner started (rank workers); calling it again does nothing."""
        if self.ranked is not None:
            self.ranked.shutdown()

    async def handle(self, engine: Engine, call: Message) -> AsyncIterator[Message]:
        if not isinstance(call, self.stage.call):
            raise TypeError(f"stage {self.stage.name} takes {self.stage.call.__name__}, not {type(call).__name__}")
        request_id = getattr(call, "request_id", None)
        if request_id:
            self.io.expect(request_id)
        async for out in self.run(engine, self.stage.call.model_validate(call)):
            if not isinstance(out, self.stage.outputs):
                raise TypeError(f"stage {self.stage.name} produced a {type(out).__name__}, not one of its declared "
                                f"outputs {[t.__name__ for t in self.stage.outputs]}")
            yield out

    async def drive(self, engine: Engine, request_id: str, program: StageProgram, *,
                    reads: str | tuple[str, ...] | None | object = DECLARED,
                    writes: str | None | object = DECLARED) -> AsyncIterator[Message]:
        """Run ``program``: feed it the payloads of ``reads`` (an edge, or several read one after the other) as
        they arrive, write what it emits of ``writes``' payload type to that edge, and yield the rest.

        Args:
            reads: the edges to feed the program from; by default those the stage declares (``StageDef.reads``).
                None: the program gets no inputs through ``drive`` (the runner fed it already).
            writes: the edge to write to; by default the one the stage declares (None if it declares none;
                a stage declaring several must name one). None: everything is yielded.
        """
        if reads is DECLARED:
            reads = self.stage.reads or None
        if writes is DECLARED:
            if len(self.stage.writes) > 1:
                raise ValueError(f"stage {self.stage.name} writes {self.stage.writes}: name the edge drive writes")
            writes = self.stage.writes[0] if self.stage.writes else None
        inputs = None
        if reads is not None:
            inputs = self.io.streams((reads,) if isinstance(reads, str) else reads, request_id)
        writer = self.io.writer(writes, request_id) if writes is not None else None
        async for out in engine.generate(request_id, program, inputs):
            if writer is not None and writer.accepts(out):
                await writer.write(out)
            else:
                yield out


class PreparedLayers:
    """A mixin for runners whose adapter (a ``PagedDecoder``) takes ``prepared_layers``: the stage's
    ``engine.ar.prepared_layers``, added to the other runner bases' ``adapter_options``."""

    def adapter_options(self):
        return {**super().adapter_options(), "prepared_layers": self.engine_spec.ar.prepared_layers}


def build_runner(family: Family, stage: str, spec: Any, connector: Connector | None = None) -> StageRunner:
    """The runner the family declares for ``stage``, on ``spec`` (a validated spec, or its values)."""
    if not isinstance(spec, family.spec):
        spec = family.spec.model_validate(spec)
    stage_def = family.graph.stage(stage)
    io = StageIO(family.graph, stage_def, spec, connector)
    runner = stage_def.runner_for(spec.stage_spec(stage).engine.backend)
    built = import_path(runner)(family.graph, stage_def, spec, io)
    built.family_path = family.path
    return built
