"""In-process connector: payloads stay Python objects in one process (``omni_serve.graph.local.LocalGraph``).

Contract: as ``omni_serve.transport.base.Connector``; ``scope = "process"``, so the Serve builder refuses it
for deployed graphs (their stages are separate processes). ``put`` keeps the object itself (no copy, no
encoding), ``get`` waits for the key on the caller's event loop and hands the object over (a second ``get`` of
the same key waits again, as on every backend), ``free`` / ``free_request`` drop what is held. Payloads nobody
reads are dropped after ``settings.DATA_TTL_S``, like the other backends'; ``close`` drops everything it holds.
"""

from __future__ import annotations

import asyncio
import time

from omni_serve import settings
from omni_serve.transport.base import Connector, DataPlaneTimeout, PeriodicSweep, split_key
from omni_serve.transport.message_types import Payload


class MemoryConnector(Connector):
    name = "memory"
    scope = "process"

    def __init__(self, ttl_s: float | None = None):
        self.ttl_s = settings.DATA_TTL_S if ttl_s is None else ttl_s
        self._items: dict[str, tuple[Payload, float]] = {}
        self._arrived: dict[str, asyncio.Event] = {}
        self._sweeper = PeriodicSweep(self.name, self.ttl_s, self.sweep)

    def _event(self, key: str) -> asyncio.Event:
        return self._arrived.setdefault(key, asyncio.Event())

    async def put(self, key: str, payload: Payload) -> None:
        self._sweeper.ensure()
        self._items[key] = (payload, time.monotonic())
        self._event(key).set()

    async def get(self, key: str, timeout: float) -> Payload:
        if key not in self._items:
            try:
                await asyncio.wait_for(self._event(key).wait(), timeout)
            except asyncio.TimeoutError:
                self._arrived.pop(key, None)
                raise DataPlaneTimeout(f"no payload under {key!r} after {timeout:.1f} s") from None
            except asyncio.CancelledError:
                self._arrived.pop(key, None)
                raise
        item = self._items.pop(key, None)
        self._arrived.pop(key, None)
        if item is None:
            raise DataPlaneTimeout(f"payload {key!r} was freed before it was read")
        return item[0]

    async def free(self, key: str) -> None:
        self._items.pop(key, None)
        self._arrived.pop(key, None)

    async def free_request(self, request_id: str) -> None:
        for key in [k for k in {**self._items, **self._arrived} if (split_key(k) or ("",))[0] == request_id]:
            await self.free(key)

    def sweep(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        stale = [k for k, (_, t) in self._items.items() if now - t > self.ttl_s]
        for key in stale:
            self._items.pop(key, None)
            self._arrived.pop(key, None)
        return len(stale)

    def stats(self) -> dict[str, int]:
        return {"unread": len(self._items)}

    def close(self) -> None:
        self._sweeper.stop()
        self._items.clear()
        self._arrived.clear()
