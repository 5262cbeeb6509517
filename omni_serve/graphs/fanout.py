"""Ingress side of a request's stage calls: open them all at once, merge their outputs, clean up always.

Contract: ``stage_events(handles, payloads, request_id=..., timeout_s=..., connectors=...)`` opens one
streaming ``generate`` call per entry of ``payloads`` (stage name -> small metadata dict) and yields
``(stage, output)`` in arrival order until every call has ended. A stage failure raises an ``OpenAIError``
naming the stage: 503 with Retry-After when the stage's replica died or is unavailable, 500 when the stage
failed on the request; passing the deadline raises a 504. Whatever ends the iteration
(success, error, the client going away), every open call is cancelled (which aborts the request in the
stage's engine) and the request's data-plane payloads are freed on every connector the graph uses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from omni_serve.api.errors import OpenAIError, internal_error
from omni_serve.transport.base import Connector

log = logging.getLogger(__name__)


def short_error(exc: BaseException) -> str:
    """The last line of an exception's text (Ray wraps remote errors in long tracebacks)."""
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


def _replica_lost_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, WorkerCrashedError, NodeDiedError, ReplicaUnavailableError, DeploymentUnavailableError,
            BackPressureError)


def stage_error(stage: str, exc: BaseException) -> OpenAIError:
    """The client's error for a failed stage call: 503 with Retry-After when the stage's replica died or is
    unavailable (a retry reaches a healthy one), 500 when the stage failed on the request itself."""
    if isinstance(exc, _replica_lost_errors()):
        return OpenAIError(f"Stage {stage} is temporarily unavailable (its replica was lost or is overloaded); "
                           "retry the request.", status_code=503, type="service_unavailable",
                           code="stage_unavailable", headers={"Retry-After": "1"})
    return internal_error(f"Stage {stage} failed: {short_error(exc)}")


async def stage_events(handles: dict[str, Any], payloads: dict[str, dict[str, Any]], *, request_id: str,
                       timeout_s: float, connectors: list[Connector]) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    calls = {stage: handles[stage].options(stream=True).generate.remote(payload)
             for stage, payload in payloads.items()}
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stage, gen):
        try:
            async for out in gen:
                await queue.put((stage, out))
            await queue.put((stage, None))
        except BaseException as exc:  # noqa: BLE001 - surfaced to the request
            await queue.put((stage, exc))

    tasks = [asyncio.create_task(pump(s, g)) for s, g in calls.items()]
    open_calls = set(calls)
    deadline = time.monotonic() + timeout_s
    try:
        while open_calls:
            remaining = deadline - time.monotonic()
            try:
                stage, item = await asyncio.wait_for(queue.get(), max(remaining, 0.001))
            except asyncio.TimeoutError:
                raise OpenAIError("The request timed out.", status_code=504, type="timeout",
                                  code="timeout") from None
            if item is None:
                open_calls.discard(stage)
            elif isinstance(item, BaseException):
                log.error("request %s: stage %s failed: %r", request_id, stage, item)
                raise stage_error(stage, item)
            else:
                yield stage, item
    finally:
        for gen in calls.values():
            gen.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Shielded: a second cancellation (the client went away while this runs) must not cut the freeing
        # short between taking the request's directory entries and releasing their payloads.
        await asyncio.shield(_free_payloads(connectors, request_id))


async def _free_payloads(connectors, request_id: str) -> None:
    for connector in connectors:
        try:
            await connector.free_request(request_id)
        except Exception:  # noqa: BLE001 - never mask the request's own outcome
            log.exception("request %s: freeing %s data-plane payloads failed", request_id, connector.name)


async def probe_stages(handles: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
    """Each stage's ``ready()`` answer, or ``{"error": ...}`` for a stage that does not answer in time."""
    async def probe(stage, handle):
        try:
            return stage, await asyncio.wait_for(handle.ready.remote(), timeout_s)
        except Exception as exc:  # noqa: BLE001
            return stage, {"error": short_error(exc)}
    return dict(await asyncio.gather(*(probe(s, h) for s, h in handles.items())))
