"""Data-plane connector interface: tensors move between stages by key, never inside handle arguments.

Contract:
- ``Connector.put(key, payload)`` stores a payload (a dict of tensors / small values) under a key;
  ``get(key, timeout)`` waits for it (``DataPlaneTimeout`` when it never comes, ``DataPlaneError`` when the
  producer is gone) and hands ownership to the caller, which ``free``s it once read;
  ``free_request(request_id)`` drops everything a request left behind (cancellation, errors).
- Keys are ``chunk_key(request_id, edge, index)``; ``ChunkWriter``/``read_chunks`` turn a key sequence into
  an ordered stream that ends with a payload whose ``end`` attribute is true (``omni_serve.graph.messages.
  StreamChunk``), reporting each put/get (backend, bytes, seconds) to the process' transfer observer when one
  is set (metrics).
- ``auto`` (every edge's default) names no backend of its own: it resolves to the fastest one that reaches every
  replica (``omni_serve.transport.auto``: shared memory on one node, Mooncake across nodes, else Ray).
- Backends register lazily by name so optional dependencies (Mooncake, shared memory) load only where a graph
  edge asks for them: the built-in ones, those of the ``omni_serve.connectors`` entry-point group (``name =
  "package.module:Class"``: every process of a deployed graph sees them) and ``register_connector`` (this
  process only: tests, in-process graphs).
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import inspect
import logging
import time
from typing import Any, AsyncIterator, Callable

log = logging.getLogger(__name__)


class DataPlaneError(RuntimeError):
    """The payload cannot be delivered (its producer died, or the backend failed)."""


class DataPlaneTimeout(DataPlaneError):
    """The payload did not arrive in time."""


def chunk_key(request_id: str, edge: str, index: int) -> str:
    return f"{request_id}/{edge}/{index}"


def split_key(key: str) -> tuple[str, str, int] | None:
    """``chunk_key``'s parts, or None for a key not made by it."""
    rid, _, rest = key.partition("/")
    edge, _, index = rest.rpartition("/")
    if not rid or not edge or not index.isdigit():
        return None
    return rid, edge, int(index)


class Connector(abc.ABC):
    name: str = "abstract"
    # Where a payload can travel: "cluster" (any node), "node" (processes of one node), "process" (in-process
    # only: the Serve builder refuses such a connector for a deployed graph).
    scope: str = "cluster"

    @classmethod
    def from_spec(cls, spec: Any = None) -> "Connector":
        """Build from the backend's ``DataPlaneSpec`` section (None: defaults)."""
        return cls()

    @abc.abstractmethod
    async def put(self, key: str, payload: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def get(self, key: str, timeout: float) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def free(self, key: str) -> None: ...

    @abc.abstractmethod
    async def free_request(self, request_id: str) -> None: ...


async def in_thread(fn, *args):
    """``fn(*args)`` in a worker thread. If the caller is cancelled meanwhile, the call still finishes
    before the cancellation propagates: transport memory is never freed while a copy or transfer uses it."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise


class PeriodicSweep:
    """Calls a connector's ``sweep()`` (sync or async) every ``min(ttl_s / 4, 5 s)`` on the event loop of
    the first ``ensure()`` call (the loop its puts run on); a failing sweep is logged, never raised."""

    def __init__(self, name: str, ttl_s: float, sweep):
        self.name, self.ttl_s, self.sweep = name, ttl_s, sweep
        self._task: asyncio.Task | None = None

    def ensure(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(min(self.ttl_s / 4, 5.0))
            try:
                result = self.sweep()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # noqa: BLE001 - housekeeping never takes the replica down
                log.exception("%s: sweep failed", self.name)


# (backend, op, bytes, seconds) -> None: counts streaming-path transfers (omni_serve.metrics sets it)
_OBSERVER: Callable[[str, str, int, float], None] | None = None


def set_transfer_observer(observer: Callable[[str, str, int, float], None] | None) -> None:
    global _OBSERVER
    _OBSERVER = observer


def transfer_observer() -> Callable[[str, str, int, float], None] | None:
    return _OBSERVER


def payload_nbytes(payload: Any) -> int:
    """Bytes of the tensors, arrays and byte strings in a payload (nested messages, dicts, lists)."""
    if isinstance(payload, dict):
        return sum(payload_nbytes(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_nbytes(v) for v in payload)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return len(payload)
    if hasattr(payload, "element_size") and hasattr(payload, "numel"):  # torch.Tensor
        return payload.element_size() * payload.numel()
    if hasattr(payload, "nbytes"):  # numpy
        return int(payload.nbytes or 0)
    if hasattr(payload, "__dict__"):  # a message (pydantic model, dataclass): its fields
        return payload_nbytes(vars(payload))
    return 0


def is_last_chunk(payload: Any) -> bool:
    """Whether a stream's payload is its last: its ``end`` attribute (or key) is true."""
    if isinstance(payload, dict):
        return bool(payload.get("end"))
    return bool(getattr(payload, "end", False))


async def observed_put(connector: Connector, key: str, payload: dict[str, Any]) -> None:
    """``connector.put`` reported to the transfer observer (if any)."""
    if _OBSERVER is None:
        return await connector.put(key, payload)
    start = time.perf_counter()
    await connector.put(key, payload)
    _OBSERVER(connector.name, "put", payload_nbytes(payload), time.perf_counter() - start)


async def observed_get(connector: Connector, key: str, timeout: float) -> dict[str, Any]:
    """``connector.get`` reported to the transfer observer (if any)."""
    if _OBSERVER is None:
        return await connector.get(key, timeout)
    start = time.perf_counter()
    payload = await connector.get(key, timeout)
    _OBSERVER(connector.name, "get", payload_nbytes(payload), time.perf_counter() - start)
    return payload


class ChunkWriter:
    """Writes one request's stream on one edge as numbered chunks."""

    def __init__(self, connector: Connector, request_id: str, edge: str):
        self.connector, self.request_id, self.edge = connector, request_id, edge
        self.index = 0

    async def write(self, payload: dict[str, Any]) -> None:
        await observed_put(self.connector, chunk_key(self.request_id, self.edge, self.index), payload)
        self.index += 1


async def read_chunks(connector: Connector, request_id: str, edge: str,
                      timeout: float) -> AsyncIterator[dict[str, Any]]:
    """Yield a stream's chunks in order until one whose ``end`` is true; each is freed once read."""
    index = 0
    while True:
        key = chunk_key(request_id, edge, index)
        payload = await observed_get(connector, key, timeout)
        await connector.free(key)
        yield payload
        if is_last_chunk(payload):
            return
        index += 1


_REGISTRY: dict[str, str] = {
    "ray": "omni_serve.transport.ray_store:RayObjectStoreConnector",
    "shm": "omni_serve.transport.shm:SharedMemoryConnector",
    "mooncake": "omni_serve.transport.mooncake:MooncakeTransferConnector",
    "mooncake_store": "omni_serve.transport.mooncake:MooncakeStoreConnector",
    "memory": "omni_serve.transport.memory:MemoryConnector",
}
_INSTANCES: dict[str, Connector] = {}


CONNECTOR_ENTRY_POINTS = "omni_serve.connectors"
_entry_points_read = False


def _registry() -> dict[str, str]:
    """The registry, with the ``omni_serve.connectors`` entry points added the first time it is read."""
    global _entry_points_read
    if not _entry_points_read:
        from importlib.metadata import entry_points

        for entry in entry_points(group=CONNECTOR_ENTRY_POINTS):
            _REGISTRY.setdefault(entry.name, entry.value)
        _entry_points_read = True
    return _REGISTRY


def register_connector(name: str, path: str) -> None:
    """Register a backend as ``module:Class`` in this process; it is imported only when first used. A deployed
    graph's processes each validate their spec: register there through the ``omni_serve.connectors`` entry-point
    group instead."""
    _REGISTRY[name] = path


def connector_stats() -> dict[str, dict]:
    """Counters of the connectors this process has built (leak checks, /health)."""
    return {name: c.stats() for name, c in _INSTANCES.items() if hasattr(c, "stats")}


def known_connectors() -> list[str]:
    """Every name an edge's ``connector`` may take: the registered backends and ``auto``."""
    from omni_serve.transport.auto import AUTO

    return sorted([*_registry(), AUTO])


def connector_class(name: str, data_plane=None) -> type[Connector]:
    """The class registered under ``name`` (``auto``: the backend it resolves to; imports its module)."""
    from omni_serve.transport.auto import resolve

    name = resolve(name, data_plane)
    registry = _registry()
    if name not in registry:
        raise ValueError(f"unknown connector {name!r}; known: {sorted(registry)}")
    module, _, cls = registry[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def get_connector(name: str, data_plane=None) -> Connector:
    """The process-wide connector of a backend, built on first use from ``data_plane`` (a ``DataPlaneSpec``);
    ``auto`` is the backend this process chose for it (``omni_serve.transport.auto``)."""
    from omni_serve.transport.auto import resolve

    name = resolve(name, data_plane)
    if name not in _INSTANCES:
        spec = data_plane.section(name) if data_plane is not None else None
        _INSTANCES[name] = connector_class(name).from_spec(spec)
    return _INSTANCES[name]
