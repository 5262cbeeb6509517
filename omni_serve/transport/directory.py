"""The data directory: one cluster-wide Ray actor that maps data-plane keys to small entries and wakes waiters.

Why it exists: Ray has no keyed object store, and a consumer opened concurrently with its producer must find a
payload by key. The ``ray`` and Mooncake connectors keep each payload's small part there (an ObjectRef, or the
codec header and where the bytes are); the ``shm`` connector names each stream's producer node; the ``nearest``
connector publishes each stream's route (``omni_serve.transport.nearest``). Payload bytes never pass through it.

Contract:
- ``directory()`` is this process' ``DirectoryClient``. ``await client.call(method, *args)`` calls a
  ``DataDirectory`` method (cancelling the awaiting task cancels the call in the actor: a cancelled consumer's
  ``wait`` leaves nothing behind); ``client.send(method, *args)`` calls it without waiting (announcements off a fast path).
- The actor is detached, named (``DIRECTORY_NAME`` in ``settings.RAY_NAMESPACE``), created by the first process
  that needs it, preferably on the head node (it dies with the cluster, not with a worker node), and restarted
  by Ray wherever it can run when its node dies anyway (``max_restarts=-1``); calls in flight then are retried
  on the new instance (``max_task_retries=-1``), which starts empty: the payloads of requests in flight are lost
  (their consumers time out, their requests fail) and later requests are served. A client whose handle failed
  for good (the actor was removed) finds or creates the actor again; a call that still fails raises
  ``DataPlaneError``.
- Entries nobody took are swept after ``OMNI_SERVE_DATA_TTL_S``; ``owned`` ones (their producer frees them and
  the bytes behind them) after ``OWNED_TTL_FACTOR`` TTLs, so a dead producer's entries do not stay forever.
- It also keeps, for a TTL and apart from the entries, the requests the ingress gave up on with calls still open
  (``abandon``, ``abandoned_among``: ``omni_serve.graph.abandoned``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from omni_serve import settings
from omni_serve.transport.base import DataPlaneError

log = logging.getLogger(__name__)

DIRECTORY_NAME = "omni_serve_data_directory"
OWNED_TTL_FACTOR = 4  # owned entries: their producer frees them at 1-2 TTLs; past 4 it is gone
CALL_ATTEMPTS = 3


@ray.remote(num_cpus=0, max_concurrency=10_000, max_restarts=-1, max_task_retries=-1)
class DataDirectory:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.entries: dict[str, tuple[object, float]] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.waiting: dict[str, int] = {}  # key -> how many ``wait`` calls wait on its event
        self.owned: set[str] = set()  # keys whose producer frees them itself after the TTL (it owns the bytes)
        # request id -> when the ingress gave up on it (omni_serve.graph.abandoned); not entries: no payload
        self.abandoned: dict[str, float] = {}
        self._sweeper = None

    def _ensure_sweeper(self):
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self):
        while True:
            await asyncio.sleep(min(self.ttl_s / 4, 5.0))
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> int:
        """Drop entries past their TTL; returns how many."""
        due = [k for k, (_, t) in self.entries.items()
               if now - t > (self.ttl_s * OWNED_TTL_FACTOR if k in self.owned else self.ttl_s)]
        for key in due:
            self.entries.pop(key, None)
            self.owned.discard(key)
        for request_id in [r for r, t in self.abandoned.items() if now - t > self.ttl_s]:
            del self.abandoned[request_id]
        return len(due)

    async def put(self, key: str, value, owned: bool = False) -> None:
        self._ensure_sweeper()
        self.entries[key] = (value, time.monotonic())
        if owned:
            self.owned.add(key)
        event = self.waiters.pop(key, None)
        if event is not None:
            event.set()

    async def wait(self, key: str, timeout: float, take: bool = False):
        """The value under ``key`` once it is there (None after ``timeout``); ``take`` removes it atomically,
        so exactly one caller gets it."""
        self._ensure_sweeper()
        if key not in self.entries:
            event = self.waiters.setdefault(key, asyncio.Event())
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                return None
            finally:  # timed out, cancelled (its caller gave up) or set
                left = self.waiting.pop(key, 1) - 1
                if left:
                    self.waiting[key] = left
                elif self.waiters.get(key) is event and not event.is_set():
                    self.waiters.pop(key, None)  # the last waiter left: nothing will set it
        entry = self.entries.pop(key, None) if take else self.entries.get(key)
        if take:
            self.owned.discard(key)
        return None if entry is None else entry[0]

    async def abandon(self, request_id: str) -> None:
        """The ingress gave up on ``request_id`` with calls of it still open (kept a TTL)."""
        self._ensure_sweeper()
        self.abandoned[request_id] = time.monotonic()

    async def abandoned_among(self, request_ids: list[str]) -> list[str]:
        """Which of ``request_ids`` the ingress gave up on (never waits)."""
        return [r for r in request_ids if r in self.abandoned]

    async def waits(self) -> int:
        """How many ``wait`` calls are waiting now (tests, operators)."""
        return sum(self.waiting.values())

    async def lookup(self, key: str):
        """The value under ``key`` now, or None (never waits)."""
        entry = self.entries.get(key)
        return None if entry is None else entry[0]

    async def free(self, key: str) -> None:
        self.entries.pop(key, None)
        self.owned.discard(key)

    async def free_prefix(self, prefix: str) -> int:
        return len(await self.take_prefix(prefix))

    async def free_prefixes(self, prefixes: list[str]) -> int:
        return sum([len(await self.take_prefix(p)) for p in prefixes])

    async def take_prefix(self, prefix: str) -> dict:
        """Remove and return every entry whose key starts with ``prefix``."""
        out = {}
        for key in [k for k in self.entries if k.startswith(prefix)]:
            out[key] = self.entries.pop(key)[0]
            self.owned.discard(key)
        return out

    async def size(self) -> int:
        return len(self.entries)

    async def keys(self, prefix: str = "") -> list[str]:
        """The keys held (tests, operators)."""
        return sorted(k for k in self.entries if k.startswith(prefix))

    async def debug_block_for(self, seconds: float) -> None:
        """Tests: block the actor's event loop ``seconds`` (every call waits), as a directory behind a network
        partition looks to its callers."""
        time.sleep(seconds)

    async def where(self) -> dict[str, str]:
        """The node this instance runs on (tests, operators)."""
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address()}


def cluster_service_options(name: str) -> dict:
    """Ray actor options of one of omni_serve's cluster-wide services (the directory, the Store master): named,
    detached, found if it exists, and preferably on the head node, which dies only with the cluster (elsewhere
    when the head is not alive)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = dict(name=name, namespace=settings.RAY_NAMESPACE, get_if_exists=True, lifetime="detached")
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node["NodeID"], soft=True)
    return options


def _actor():
    """Find the directory actor, or create it."""
    return DataDirectory.options(**cluster_service_options(DIRECTORY_NAME)).remote(settings.DATA_TTL_S)


class DirectoryClient:
    """This process' handle on the directory actor, found again when it failed for good."""

    def __init__(self):
        self._handle = None

    @property
    def handle(self):
        if self._handle is None:
            self._handle = _actor()
        return self._handle

    async def call(self, method: str, *args, **kwargs):
        """``DataDirectory.<method>(*args, **kwargs)``; ``DataPlaneError`` when the directory cannot be reached."""
        for attempt in range(CALL_ATTEMPTS):
            handle = self.handle
            ref = getattr(handle, method).remote(*args, **kwargs)
            try:
                return await ref
            except asyncio.CancelledError:
                # The caller gave up (its request ended): cancel the call in the actor too, so a ``wait`` does
                # not hold its waiter there until its own timeout.
                ray.cancel(ref)
                raise
            except ray.exceptions.RayActorError as exc:
                if self._handle is handle:
                    self._handle = None  # find or create it again
                if attempt == CALL_ATTEMPTS - 1:
                    raise DataPlaneError(f"the data directory is unreachable: {exc}") from exc
                log.warning("data directory call %s failed (%s); finding the directory again", method, exc)
                await asyncio.sleep(0.2 * 2 ** attempt)

    def send(self, method: str, *args, **kwargs) -> None:
        """Call without waiting for the answer (an announcement): a failure only drops the handle."""
        handle = self.handle
        ref = getattr(handle, method).remote(*args, **kwargs)

        def done(fut):
            if fut.exception() is not None and self._handle is handle:
                self._handle = None
        try:
            ref.future().add_done_callback(done)
        except Exception:  # noqa: BLE001 - outside Ray's event loop integration: nothing to watch
            pass

    def reset(self) -> None:
        self._handle = None


_CLIENT: DirectoryClient | None = None


def directory() -> DirectoryClient:
    """This process' directory client (created on first use)."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = DirectoryClient()
    return _CLIENT
