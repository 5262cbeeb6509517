"""Which stages of the ingress' application can take a request now: Serve's own view, polled.

Contract: ``StageAvailability(stages, can_be_empty)`` polls Serve's controller (``serve.status()``, in a thread,
every ``period_s``) for the running replicas of each stage deployment of this ingress' application, once
``start()`` was called on the ingress' event loop. ``missing()`` lists the stages with no running replica (none
until the first answer: a stage is taken to be there until Serve says otherwise; stages whose autoscaling allows
zero replicas never count as missing). The ingress answers new requests 503 with ``Retry-After`` while a stage
is missing, instead of queueing them for a replica that may never come (its node is gone and nowhere else has
the resources its placement asks for), and ``/health`` says which stages are missing.

Why poll: Serve's handles queue a request while a deployment has no replica and say nothing of it; the
controller's status is the one place that knows, and one call a second per ingress replica costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)


class StageAvailability:
    def __init__(self, stages: list[str], can_be_empty: set[str] | None = None, period_s: float = 1.0):
        self.stages = [s for s in stages if s not in (can_be_empty or set())]
        self.period_s = period_s
        self.running: dict[str, int] = {}
        self.checked_at: float | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._poll_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def missing(self) -> list[str]:
        return [s for s in self.stages if self.running.get(s, 1) == 0]

    async def _poll_forever(self) -> None:
        from ray import serve

        app = serve.get_replica_context().app_name
        while True:
            try:
                status = await asyncio.to_thread(serve.status)
                deployments = status.applications[app].deployments
                self.running = {s: deployments[s].replica_states.get("RUNNING", 0)
                                for s in self.stages if s in deployments}
                self.checked_at = time.monotonic()
            except Exception:  # noqa: BLE001 - keep the last answer; the controller may be restarting
                log.debug("stage availability: serve.status() failed", exc_info=True)
            await asyncio.sleep(self.period_s)
