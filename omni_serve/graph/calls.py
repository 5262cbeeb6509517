"""The ingress' side of a graph: a request's stage calls, opened at once and merged, typed, always cleaned up.

Contract: ``StageCalls(graph, spec, open_call, probe, connector=None)``; ``StageCalls.over_serve(graph, spec,
handles)`` builds it over Ray Serve handles (``omni_serve.graph.local`` builds it over in-process runners).
Edges use the connectors the spec names (``edges.<edge>.connector``), or ``connector`` for all.
- ``put(request_id, edge, payload)``: writes a payload on an edge the ingress feeds (``GraphDef.ingress_writes``),
  e.g. a request's preprocessed media; the payload must be the edge's declared type.
- ``stream(request_id, calls, timeout_s, inputs=None)``: opens one streaming call per entry of ``calls`` (stage
  name -> the stage's declared call message), puts ``inputs`` (edge -> payload, as ``put``) and yields
  ``(stage, output)`` in arrival order until every call ended. Each
  output must be one of the stage's declared output types. A stage failure raises an ``OpenAIError`` naming the
  stage: 503 with Retry-After when the stage's replica died, is unavailable, is shutting down or its queue is
  full, whether the call was refused when opened or failed later (or, per ``missing_stages``, a stage of the
  request lost its last replica while the request waits), 500 when the stage failed on the request; an input
  the data plane could not take is a 503 too; passing the deadline raises a 504. Whatever ends the iteration (success,
  error, the client going away, a failure while putting the inputs or opening the calls), every open call is
  cancelled (which aborts the request in the stage's engine), the request is marked abandoned when a call of it
  was still open (``on_abandoned``; over Serve ``omni_serve.graph.abandoned``, for the calls whose cancel gets
  lost) and the request's data-plane payloads are freed on every connector the deployed graph uses.
- ``health()``: each deployed stage's ``ready()`` answer, or ``{"error": ...}`` for one that does not answer.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Protocol

from omni_serve.api.errors import Draining, OpenAIError, internal_error
from omni_serve.graph.graph import INGRESS, GraphDef
from omni_serve.graph.messages import Message
from omni_serve.transport.base import Connector, DataPlaneError, chunk_key, observed_put
from omni_serve.transport.connectors import get_connector

log = logging.getLogger(__name__)


class StageCall(Protocol):
    """One open streaming call: its outputs as they come; ``cancel()`` aborts it (Serve's response generator)."""

    def __aiter__(self) -> AsyncIterator[Message]: ...

    def cancel(self) -> None: ...


def short_error(exc: BaseException) -> str:
    """The last line of an exception's text (Ray wraps remote errors in long tracebacks)."""
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


def _replica_lost_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError, DeploymentUnavailableError,
            BackPressureError)


def stage_error(stage: str, exc: BaseException, request_id: str, retry_after_s: float = 1.0) -> OpenAIError:
    """The client's error for a failed stage call: 503 with ``Retry-After`` (``retry_after_s``, whole seconds) when
    the stage's replica died or lost one of its ranks, is unavailable, is shutting down (``Draining``: a retry
    reaches a healthy one) or its queue is full (Serve's ``BackPressureError``, past the stage's
    ``max_queued_requests``), 500 when the stage failed on the request itself. The message is fixed (stage and
    request id): what went wrong inside the stage goes to the log, never to the client."""
    from omni_serve.parallel.group import RankLost  # a rank of the stage's replica died: the replica is replaced

    if isinstance(exc, (*_replica_lost_errors(), Draining, ReplicaGone, RankLost)):
        return OpenAIError(f"Stage {stage} is temporarily unavailable (its replica was lost, is shutting down or "
                           f"is overloaded); retry the request (request {request_id}).", status_code=503,
                           type="service_unavailable", code="stage_unavailable",
                           headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})
    return internal_error(f"Stage {stage} failed on request {request_id}; the details are in the server log.")


FREE_WAIT_S = 5.0  # how long a request's end waits for its data-plane cleanup before leaving it to the background
_BACKGROUND: set[asyncio.Task] = set()


async def free_within(cleanup: Awaitable[None], request_id: str, wait_s: float = FREE_WAIT_S) -> None:
    """Run ``cleanup`` shielded from cancellation; wait for it at most ``wait_s``, then let it finish on its own."""
    task = asyncio.ensure_future(cleanup)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    done, _ = await asyncio.wait([task], timeout=wait_s)
    if not done:
        log.warning("request %s: data-plane cleanup still running after %.0f s; it goes on in the background",
                    request_id, wait_s)


def _cancel_all(calls) -> None:
    """Cancel every call. Serve's ``cancel()`` re-raises the error a call was refused with (e.g. its queue was
    full: ``BackPressureError``), which the request has already answered: nothing to cancel there."""
    for call in calls:
        try:
            call.cancel()
        except Exception:  # noqa: BLE001 - the call never started
            pass


class ReplicaGone(RuntimeError):
    """A stage of a request in flight has no running replica any more (its node died)."""


WATCH_PERIOD_S = 1.0  # how often a waiting request looks whether its stages still have a replica


class StageCalls:
    def __init__(self, graph: GraphDef, spec: Any, open_call: Callable[[str, Message], StageCall],
                 probe: Callable[[str], Awaitable[dict[str, Any]]], connector: Connector | None = None):
        self.graph, self.spec = graph, spec
        self.retry_after_s = spec.ingress.retry_after_s  # the 503s' Retry-After
        # () -> stages with no running replica now (the ingress sets it: omni_serve.deployments.availability)
        self.missing_stages: Callable[[], list[str]] = list
        self._open, self._probe = open_call, probe
        self.stages = [s.name for s in graph.deployed(spec.layout())]
        links = graph.links(spec.layout())
        if connector is None:
            self._edge_connector = {link.edge: get_connector(spec.edge_spec(link.edge).connector, spec.data_plane)
                                    for link in links}
        else:  # one connector for every edge (in-process graphs)
            self._edge_connector = {link.edge: connector for link in links}
        # Every connector the deployed graph uses: a request's payloads are freed on each when it ends.
        self.connectors: list[Connector] = list({id(c): c for c in self._edge_connector.values()}.values())
        self._ingress_edges = {link.edge for link in links if link.writer == INGRESS}
        # (request_id) -> None: called when a request ends with calls of it still open, so that a call whose cancel
        # got lost stops too (omni_serve.graph.abandoned; over_serve sets it).
        self.on_abandoned: Callable[[str], None] | None = None

    @classmethod
    def over_serve(cls, graph: GraphDef, spec: Any, handles: Mapping[str, Any]) -> "StageCalls":
        """Calls over Ray Serve deployment handles (stage name -> handle of its deployment)."""
        async def probe(stage: str) -> dict[str, Any]:
            return await handles[stage].ready.remote()

        from omni_serve.graph.abandoned import mark_abandoned

        calls = cls(graph, spec, lambda stage, call: handles[stage].options(stream=True).generate.remote(call), probe)
        calls.on_abandoned = mark_abandoned
        return calls

    async def put(self, request_id: str, edge: str, payload: Message) -> None:
        if edge not in self._ingress_edges:
            raise ValueError(f"the ingress writes no edge {edge!r} in this graph (it writes {sorted(self._ingress_edges)})")
        expected = self.graph.edge(edge).payload
        if not isinstance(payload, expected):
            raise TypeError(f"edge {edge} carries {expected.__name__}, not {type(payload).__name__}")
        await observed_put(self._edge_connector[edge], chunk_key(request_id, edge, 0), payload)

    async def _put_all(self, request_id: str, inputs: Mapping[str, Message]) -> None:
        for edge, payload in inputs.items():
            await self.put(request_id, edge, payload)

    def _check_call(self, stage: str, call: Message) -> None:
        if stage not in self.stages:
            raise ValueError(f"stage {stage!r} is not deployed in this graph (deployed: {self.stages})")
        expected = self.graph.stage(stage).call
        if not isinstance(call, expected):
            raise TypeError(f"stage {stage} takes {expected.__name__}, not {type(call).__name__}")

    async def stream(self, request_id: str, calls: Mapping[str, Message], timeout_s: float,
                     inputs: Mapping[str, Message] | None = None) -> AsyncIterator[tuple[str, Message]]:
        opened: dict[str, StageCall] = {}
        opening = None
        deadline = time.monotonic() + timeout_s
        try:
            for stage, call in calls.items():
                self._check_call(stage, call)
            # Calls first, then the inputs: a stage says where it reads from when its call starts, and a
            # connector that routes by the reader's node (nearest) waits for that word on its first put.
            for opening, call in calls.items():
                opened[opening] = self._open(opening, call)
            opening = None
            if inputs:  # under the deadline too: a put may wait on the data plane (a route, the directory)
                await asyncio.wait_for(self._put_all(request_id, inputs), max(deadline - time.monotonic(), 0.001))
        except BaseException as exc:
            self._abandon(request_id, opened.values())
            await free_within(self.free(request_id), request_id)
            if opening is not None and isinstance(exc, Exception):  # the stage's handle refused the call
                log.error("request %s: opening a call of stage %s failed: %r", request_id, opening, exc)
                raise stage_error(opening, exc, request_id, self.retry_after_s) from None
            if isinstance(exc, TimeoutError):
                log.error("request %s: its inputs were not taken before its deadline", request_id)
                raise OpenAIError(f"The request timed out (request {request_id}).", status_code=504,
                                  type="timeout", code="timeout") from None
            if isinstance(exc, DataPlaneError):
                log.error("request %s: putting its inputs failed: %r", request_id, exc)
                raise OpenAIError(f"The data plane is unavailable; retry the request (request {request_id}).",
                                  status_code=503, type="service_unavailable", code="data_plane_unavailable",
                                  headers={"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}) from None
            raise
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stage, gen):
            try:
                async for out in gen:
                    await queue.put((stage, out))
                await queue.put((stage, None))
            except BaseException as exc:  # noqa: BLE001 - surfaced to the request
                await queue.put((stage, exc))

        tasks = [asyncio.create_task(pump(s, g)) for s, g in opened.items()]
        open_calls = set(opened)
        next_watch = time.monotonic() + WATCH_PERIOD_S
        try:
            while open_calls:
                now = time.monotonic()
                # Every watch period, whether or not outputs keep coming: a stage streaming what it already has
                # (a talker speaking the text it was sent) must not hide that another one's node is gone.
                if now >= next_watch:
                    next_watch = now + WATCH_PERIOD_S
                    lost = [s for s in self.missing_stages() if s in open_calls]
                    if lost:
                        log.error("request %s: stage %s has no running replica any more", request_id, lost[0])
                        raise stage_error(lost[0], ReplicaGone(lost[0]), request_id, self.retry_after_s) from None
                try:
                    stage, item = await asyncio.wait_for(queue.get(), max(min(deadline, next_watch) - now, 0.001))
                except asyncio.TimeoutError:
                    if time.monotonic() < deadline:
                        continue
                    raise OpenAIError(f"The request timed out (request {request_id}).", status_code=504,
                                      type="timeout", code="timeout") from None
                if item is None:
                    open_calls.discard(stage)
                elif isinstance(item, BaseException):
                    log.error("request %s: stage %s failed: %r", request_id, stage, item)
                    raise stage_error(stage, item, request_id, self.retry_after_s)
                elif not isinstance(item, self.graph.stage(stage).outputs):
                    log.error("request %s: stage %s sent a %s, not one of its declared outputs",
                              request_id, stage, type(item).__name__)
                    raise internal_error(f"Stage {stage} sent an unexpected output (request {request_id}).")
                else:
                    yield stage, item
        finally:
            self._abandon(request_id, [opened[s] for s in open_calls])
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Shielded: a second cancellation (the client went away while this runs) must not cut the freeing
            # short between taking the request's directory entries and releasing their payloads. Bounded: the
            # client's answer never waits on cleanup for long (the data directory may be restarting after its
            # node died); what is left finishes in the background.
            await free_within(self.free(request_id), request_id)

    def _abandon(self, request_id: str, calls) -> None:
        """Cancel the request's calls still open, and mark it abandoned for those whose cancel gets lost."""
        calls = list(calls)
        if calls:
            _cancel_all(calls)
            if self.on_abandoned is not None:
                self.on_abandoned(request_id)

    async def free(self, request_id: str) -> None:
        """Drop everything the request left on the data plane (every connector of the graph)."""
        for connector in self.connectors:
            try:
                await connector.free_request(request_id)
            except Exception:  # noqa: BLE001 - never mask the request's own outcome
                log.exception("request %s: freeing %s data-plane payloads failed", request_id, connector.name)

    async def health(self, timeout_s: float = 5.0) -> dict[str, Any]:
        async def probe(stage):
            try:
                return stage, await asyncio.wait_for(self._probe(stage), timeout_s)
            except Exception as exc:  # noqa: BLE001
                return stage, {"error": short_error(exc)}
        return dict(await asyncio.gather(*(probe(s) for s in self.stages)))
