"""The ingress' view of the graph's health, refreshed at most once per period however often ``/health`` is asked.

Contract: ``GraphHealth(stages, data_plane, ttl_s)`` where ``stages()`` returns each stage's ``ready()`` answer
(``{"error": ...}`` for one that did not answer) and ``data_plane()`` the data plane's state (``{"error": ...}``
when its directory does not answer). ``await health.get()`` returns ``(stages, data_plane)``: the last answer
while it is younger than ``ttl_s``; past that, one refresh starts (never two at once) and the last answer is
returned meanwhile; only the very first call waits for one. So a flood of ``/health`` calls costs the stages at
most one probe each per ``ttl_s``. ``get(fresh=True)`` probes now (the ingress allows it to authenticated callers
only: ``/health?fresh=1``, for operators and tests that need the state after an action).

``directory_state(timeout_s, stale_s)`` is the data plane's part for a served graph: the directory actor (every
cross-process connector keeps its keys, routes or stream entries there) is pinged and waited for ``timeout_s``. A
ping that errs (the actor is dead or unreachable) is an error at once. A ping still unanswered then is ``"slow"``,
with the last answer's entries and age, while the directory answered within ``stale_s``: on a saturated machine an
actor call can take seconds while every request still gets through, and a 503 then would report an outage that is
not there. Past ``stale_s`` without an answer it is an error.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

Probe = Callable[[], Awaitable[dict[str, Any]]]

HEALTH_TTL_S = 2.0  # how old the answer /health gives may be
DIRECTORY_TIMEOUT_S = 3.0  # a ping waits this long, then /health reports the last answer
DIRECTORY_STALE_S = 10.0  # with no answer for this long, the directory is reported down


class GraphHealth:
    def __init__(self, stages: Probe, data_plane: Probe, ttl_s: float = HEALTH_TTL_S):
        self._stages, self._data_plane, self.ttl_s = stages, data_plane, ttl_s
        self._value: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._at = 0.0
        self._refresh_task: asyncio.Task | None = None
        self.refreshes = 0  # probes run so far (tests, operators)

    async def _refresh(self) -> tuple[dict[str, Any], dict[str, Any]]:
        stages, data_plane = await asyncio.gather(self._stages(), self._data_plane())
        self._value, self._at = (stages, data_plane), time.monotonic()
        self.refreshes += 1
        return self._value

    async def get(self, fresh: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        if fresh:
            return await self._refresh()
        fresh = self._value is not None and time.monotonic() - self._at < self.ttl_s
        if not fresh and (self._refresh_task is None or self._refresh_task.done()):
            self._refresh_task = asyncio.ensure_future(self._refresh())
        if self._value is None:
            return await asyncio.shield(self._refresh_task)
        return self._value


class _LastAnswer:
    """The directory's last answer in this process: when (monotonic seconds) and its entries."""

    at = float("-inf")
    entries: int | None = None


async def directory_state(timeout_s: float = DIRECTORY_TIMEOUT_S,
                          stale_s: float = DIRECTORY_STALE_S) -> dict[str, Any]:
    """``{"directory": "ok", "entries": n}``; ``{"directory": "slow", "entries": n, "last_answer_s": age}`` when the
    ping took longer than ``timeout_s`` but the directory answered within ``stale_s``; else ``{"error": ...}``."""
    from omni_serve.transport.directory import directory

    try:
        entries = await asyncio.wait_for(directory().call("size"), timeout_s)
    except asyncio.TimeoutError:
        age = time.monotonic() - _LastAnswer.at
        if age < stale_s:
            return {"directory": "slow", "entries": _LastAnswer.entries, "last_answer_s": round(age, 1)}
        return {"error": f"the data directory did not answer within {timeout_s:g} s, nor in the last {stale_s:g} s"}
    except Exception as exc:  # noqa: BLE001 - unreachable, whatever the cause
        return {"error": f"the data directory is unreachable: {str(exc).strip().splitlines()[-1][:200]}"}
    _LastAnswer.at, _LastAnswer.entries = time.monotonic(), entries
    return {"directory": "ok", "entries": entries}
