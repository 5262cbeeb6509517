"""A family's graph in one process, without Ray: the same runners, engines and frontend the served graph runs.

Contract: ``LocalGraph(family, args, connector=None)`` validates ``args`` like the Serve builder, then builds the
runner and engine of every stage the layout deploys (loading each stage's model once), ``stages`` (the
``StageCalls`` the frontend uses, over the runners instead of Serve handles) and ``frontend`` (the family's own).
Every edge goes through one connector: ``connector`` if given (e.g. shared memory, to exercise encoding), else
the in-process ``memory`` connector. ``runners[stage]``/``engines[stage]`` are there for tests that drive one
stage directly; ``aclose()`` stops every engine (idempotent); ``async with LocalGraph(...)`` does both.

What it is for: oracle tests of whole graphs without Ray, debugging a family in one process, and tools that
want a graph's output without a cluster. The wiring comes from the graph declaration, like the builder's.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from omni_serve.graph.calls import StageCalls
from omni_serve.graph.family import Family
from omni_serve.graph.messages import Message
from omni_serve.graph.registry import import_path
from omni_serve.graph.runner import StageRunner, build_runner
from omni_serve.transport.base import Connector


class _LocalCall:
    """A stage call on an in-process runner; cancelling the task that iterates it aborts the request."""

    def __init__(self, outputs: AsyncIterator[Message]):
        self._outputs = outputs

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._outputs

    def cancel(self) -> None:
        pass  # the caller cancels the task iterating us: the runner's generator unwinds and aborts the request


class LocalGraph:
    def __init__(self, family: Family, args: dict[str, Any] | None = None, connector: Connector | None = None):
        args = dict(args or {})
        if connector is None:
            args.update({f"edges.{e.name}.connector": "memory" for e in family.graph.edges})
        self.family = family
        self.spec = family.validate(args, served=False)
        self.runners: dict[str, StageRunner] = {stage.name: build_runner(family, stage.name, self.spec, connector)
                                                for stage in family.graph.deployed(self.spec.layout())}
        self.engines = {name: runner.make_engine() for name, runner in self.runners.items()}
        self.stages = StageCalls(family.graph, self.spec, self._open, self._probe, connector)
        self.frontend = import_path(family.frontend)(self.spec, self.stages)
        self._closed = False

    def _open(self, stage: str, call: Message) -> _LocalCall:
        return _LocalCall(self.runners[stage].handle(self.engines[stage], call))

    async def _probe(self, stage: str) -> dict[str, Any]:
        engine = self.engines[stage]
        return {"stage": stage, **engine.stats(), "load": engine.load()}

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(engine.cleanup() for engine in self.engines.values()))
        for runner in self.runners.values():
            runner.close()  # rank workers, if a stage has any

    async def __aenter__(self) -> "LocalGraph":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
