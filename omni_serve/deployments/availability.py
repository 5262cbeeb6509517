"""Which stages of the ingress' application can take a request now: the running replicas its handles route to.

Contract: ``StageAvailability(handles, can_be_empty, grace_s)`` over the ingress' stage handles (stage name ->
Serve ``DeploymentHandle``). ``missing()`` lists the stages whose handle knows the deployment's running replicas
and has counted none at every look for at least ``grace_s`` (3 s), with no gap longer than that between two looks
(a stage nobody looked at for a while may have come back in between): a handle can count none for a moment while
Serve replaces a replica (a migration off a draining node, a rolling update), the old one refusing calls before the
handle hears of the new one, and a request then waits for the new one as Serve queues it. A stage whose handle
has not heard from Serve yet is taken to be there, and stages whose autoscaling allows zero replicas
(``can_be_empty``) never count as missing. ``/health`` asks without the grace: it turns 503 at the first empty
look. The ingress answers new requests 503 with
``Retry-After`` while a stage is missing, instead of queueing them for a replica that may never come (its node
is gone and nowhere else has the resources its placement asks for), ends requests in flight that wait on such a
stage (``StageCalls.missing_stages``), and ``/health`` names the missing stages.

Why the handle's router: it holds the deployment's running replicas, pushed by Serve's controller as they change
(long poll) and dropped at once when a call finds a replica's actor dead, so asking it costs nothing. Serve has no
public accessor for that set (``running_replicas_populated()`` is public, the set is not), and asking the
controller instead (``serve.status()``) took ~130 ms of its time per call on a busy 2-core machine: polled by
every ingress replica, that slowed the whole cluster. Ray is pinned (pyproject), and if the private path ever
moves, ``running_replicas`` answers None: no stage is reported missing, requests queue as Serve queues them, and
the multi-node tests (which need the fast 503) fail.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

GRACE_S = 3.0  # a stage counted empty for this long is missing


def running_replicas(handle: Any) -> int | None:
    """Running replicas the handle routes to, or None while it does not know (not initialized, or no answer
    from Serve yet)."""
    try:
        if not handle.running_replicas_populated():
            return None
        return len(handle._router._asyncio_router._active_request_router.curr_replicas)
    except AttributeError:
        return None


class StageAvailability:
    def __init__(self, handles: Mapping[str, Any], can_be_empty: set[str] | None = None, grace_s: float = GRACE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.handles = {s: h for s, h in handles.items() if s not in (can_be_empty or set())}
        self.grace_s, self._clock = grace_s, clock
        self._empty_since: dict[str, float] = {}  # stage -> when it was first counted empty, since it last was not
        self._last_look: dict[str, float] = {}
        for handle in self.handles.values():
            handle.options()  # initializes the handle's router (calls share it), so it learns the replicas now

    def missing(self, grace: bool = True) -> list[str]:
        """The stages missing now; ``grace=False``: every stage counted empty at this look (``/health``: a probe
        may see a blip; a request must not be refused for one)."""
        now, out = self._clock(), []
        for stage, handle in self.handles.items():
            last, self._last_look[stage] = self._last_look.get(stage), now
            if running_replicas(handle) != 0:
                self._empty_since.pop(stage, None)
                continue
            if last is None or now - last > self.grace_s:  # nobody looked for a while: it may have come back
                self._empty_since[stage] = now
            since = self._empty_since.setdefault(stage, now)
            if not grace or now - since >= self.grace_s:
                out.append(stage)
        return out
