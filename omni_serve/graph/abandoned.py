"""Stage calls whose request the ingress has given up on, found and cancelled in the stage's replica.

Why: when a request ends early (a stage failed, its deadline passed, the client went away) the ingress cancels
every call of it still open, and Serve forwards that as a cancellation of the call's task in the replica. That
forwarding is best effort (Ray Serve's ``DeploymentResponse.cancel``): a cancel that meets a call while it is
being assigned or just starting can be lost. The call then waits for upstream payloads that will never come
until its data timeout (the request deadline: minutes), holding an engine slot and keeping its replica from
shutting down (the suite met it: a code2wav call left waiting after its request was cancelled kept
``serve.delete`` past its 60 s).

Contract:
- The ingress marks a request it gave up on while calls of it were still open: ``mark_abandoned(request_id)``
  tells the data directory (``DataDirectory.abandon``, without waiting; kept there for the data TTL).
- A stage replica runs each call under ``AbandonedCalls.track(request_id)``; every ``CHECK_PERIOD_S`` it asks the
  directory, in one call, which of its calls older than ``CHECK_PERIOD_S`` belong to marked requests, and cancels
  their tasks (a warning names each): the call ends as a cancelled one does, its engine request aborted and its
  payloads freed. Cost: one directory call per replica per period, only while it runs calls that old; nothing
  when the directory cannot be reached (the call's own data timeout still bounds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

CHECK_PERIOD_S = 2.0


def mark_abandoned(request_id: str) -> None:
    """Tell the stages that the ingress has given up on ``request_id`` (its calls still running there stop)."""
    from omni_serve.transport.directory import directory

    try:
        directory().send("abandon", request_id)
    except Exception:  # noqa: BLE001 - the stages' own data timeouts are the backstop
        log.warning("request %s: could not mark it abandoned in the data directory", request_id, exc_info=True)


class AbandonedCalls:
    """The running calls of one replica, and the watcher that cancels those whose request was abandoned."""

    def __init__(self, stage: str, lookup=None, period_s: float = CHECK_PERIOD_S):
        """``lookup(request_ids) -> awaitable of those abandoned``; None: the data directory's ``abandoned_among``."""
        self.stage, self.period_s = stage, period_s
        self._lookup = lookup
        self._calls: dict[asyncio.Task, tuple[str, float]] = {}
        self._cancelled: set[asyncio.Task] = set()  # tracked calls cancelled here (once each)
        self._watcher: asyncio.Task | None = None
        self.cancelled = 0  # calls this replica cancelled (tests, /health)

    @contextlib.contextmanager
    def track(self, request_id: str) -> Iterator[None]:
        """Around one call, in the task that runs it."""
        task = asyncio.current_task()
        self._calls[task] = (request_id, time.monotonic())
        if self._watcher is None or self._watcher.done():
            # a context of its own: not the first call's (Serve's request context tags the log lines)
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), context=contextvars.Context())
        try:
            yield
        finally:
            self._calls.pop(task, None)
            self._cancelled.discard(task)

    async def _abandoned_among(self, request_ids: list[str]) -> list[str]:
        if self._lookup is not None:
            return await self._lookup(request_ids)
        from omni_serve.transport.directory import directory

        return await directory().call("abandoned_among", request_ids)

    async def check(self) -> int:
        """Cancel the calls older than a period whose request was marked; returns how many."""
        now = time.monotonic()
        old = {task: rid for task, (rid, since) in self._calls.items()
               if now - since >= self.period_s and task not in self._cancelled}
        if not old:
            return 0
        try:  # bounded: a directory behind a partition must not stop the checks for good
            abandoned = set(await asyncio.wait_for(self._abandoned_among(sorted(set(old.values()))),
                                                   5 * self.period_s))
        except Exception as exc:  # noqa: BLE001 - unreachable directory: the calls' own data timeouts bound them
            log.debug("stage %s: could not ask the directory for abandoned requests: %r", self.stage, exc)
            return 0
        found = 0
        for task, rid in old.items():
            # still running the call it ran before the lookup: one that ended meanwhile (Serve's own cancel
            # arrived, and it is cleaning up) is left alone
            if rid in abandoned and self._calls.get(task, ("",))[0] == rid and task not in self._cancelled:
                log.warning("stage %s: request %s was abandoned at the ingress but its call here was still running "
                            "(the cancel did not reach it); cancelling it", self.stage, rid)
                self._cancelled.add(task)
                task.cancel()
                found += 1
        self.cancelled += found
        return found

    async def _watch(self) -> None:
        while self._calls:
            await asyncio.sleep(self.period_s)
            await self.check()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
