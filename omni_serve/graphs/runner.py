"""Base of a graph's per-stage runner: turns a request's metadata into a program and wires its data plane.

Contract: a runner is built once per replica from ``(stage_name, graph_spec_dict)``; ``modules()`` lists the
torch modules it holds; ``run(engine, request)`` runs one request: builds the program, pumps upstream chunks
from the connector into it, writes its ``downstream`` outputs as a chunk stream and yields the rest to the
caller. ``make_engine()`` builds the replica's engine. Runners hold no per-request state; programs do.
"""

from __future__ import annotations

import abc
from typing import Any, AsyncIterator

from omni_serve.engines.base import StageProgram
from omni_serve.engines.loop import LoopEngine
from omni_serve.engines.stepper import StepEngine
from omni_serve.graphs.spec import EngineSpec
from omni_serve.transport.base import ChunkWriter, Connector, get_connector, read_chunks


class StageRunner(abc.ABC):
    stage: str
    spec: Any  # the graph's validated spec (has ``edges`` and ``data_timeout_s``)
    engine_spec: EngineSpec

    def make_engine(self) -> LoopEngine:
        """The engine this stage's replicas host (one-shot stages: ``StepEngine``; AR stages override)."""
        s = self.engine_spec
        return StepEngine(self.stage, max_active=s.max_active_requests, torch_threads=s.torch_threads)

    @abc.abstractmethod
    def modules(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def run(self, engine: LoopEngine, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...

    @staticmethod
    async def drive(engine: LoopEngine, request_id: str, program: StageProgram, *,
                    source: tuple[Connector, str, float] | None = None,
                    sink: tuple[Connector, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """Run ``program``; ``source`` = (connector, edge, timeout) to read, ``sink`` = (connector, edge)."""
        inputs = None
        if source is not None:
            conn, edge, timeout = source
            inputs = read_chunks(conn, request_id, edge, timeout)
        writer = ChunkWriter(sink[0], request_id, sink[1]) if sink is not None else None
        async for out in engine.generate(request_id, program, inputs):
            down = out.pop("downstream", None)
            if down is not None and writer is not None:
                await writer.write(down)
            if out:
                yield out

    def connector(self, name: str) -> Connector:
        return get_connector(name, self.spec.data_plane)

    def edge_field(self, edge: str) -> str:
        """The ``spec.edges`` field whose connector carries ``edge`` ("a.b" -> "a_b"; graphs may remap)."""
        return edge.replace(".", "_")

    def source(self, edge: str) -> tuple[Connector, str, float]:
        """``drive``'s ``source`` for reading ``edge``: its connector, name and the graph's data timeout."""
        return self.sink(edge) + (self.spec.data_timeout_s,)

    def sink(self, edge: str) -> tuple[Connector, str]:
        """``drive``'s ``sink`` for writing ``edge``."""
        return self.connector(getattr(self.spec.edges, self.edge_field(edge)).connector), edge
