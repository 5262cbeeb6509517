"""Data-plane connector interface: tensors move between stages by key, never inside handle arguments.

Contract:
- ``Connector.put(key, payload)`` stores a payload (a dict of tensors / small values) under a key;
  ``get(key, timeout)`` waits for it (``DataPlaneTimeout`` when it never comes, ``DataPlaneError`` when the
  producer is gone) and hands ownership to the caller, which ``free``s it once read;
  ``free_request(request_id)`` drops everything a request left behind (cancellation, errors).
- Keys are ``chunk_key(request_id, edge, index)``; ``ChunkWriter``/``read_chunks`` turn a key sequence into
  an ordered stream that ends with a payload carrying ``end: True``.
- Backends register lazily by name (``register_connector``) so optional dependencies (Mooncake, shared
  memory) load only where a graph edge asks for them.
"""

from __future__ import annotations

import abc
import importlib
from typing import Any, AsyncIterator


class DataPlaneError(RuntimeError):
    """The payload cannot be delivered (its producer died, or the backend failed)."""


class DataPlaneTimeout(DataPlaneError):
    """The payload did not arrive in time."""


def chunk_key(request_id: str, edge: str, index: int) -> str:
    return f"{request_id}/{edge}/{index}"


class Connector(abc.ABC):
    name: str = "abstract"

    @abc.abstractmethod
    async def put(self, key: str, payload: dict[str, Any]) -> None: ...

    @abc.abstractmethod
    async def get(self, key: str, timeout: float) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def free(self, key: str) -> None: ...

    @abc.abstractmethod
    async def free_request(self, request_id: str) -> None: ...


class ChunkWriter:
    """Writes one request's stream on one edge as numbered chunks."""

    def __init__(self, connector: Connector, request_id: str, edge: str):
        self.connector, self.request_id, self.edge = connector, request_id, edge
        self.index = 0

    async def write(self, payload: dict[str, Any]) -> None:
        await self.connector.put(chunk_key(self.request_id, self.edge, self.index), payload)
        self.index += 1


async def read_chunks(connector: Connector, request_id: str, edge: str,
                      timeout: float) -> AsyncIterator[dict[str, Any]]:
    """Yield a stream's chunks in order until one has ``end: True``; each is freed once read."""
    index = 0
    while True:
        key = chunk_key(request_id, edge, index)
        payload = await connector.get(key, timeout)
        await connector.free(key)
        yield payload
        if payload.get("end"):
            return
        index += 1


_REGISTRY: dict[str, str] = {"ray": "omni_serve.transport.ray_store:RayObjectStoreConnector"}
_INSTANCES: dict[str, Connector] = {}


def register_connector(name: str, path: str) -> None:
    """Register a backend as ``module:Class``; it is imported only when first used."""
    _REGISTRY[name] = path


def get_connector(name: str) -> Connector:
    """The process-wide connector instance of a backend."""
    if name not in _INSTANCES:
        if name not in _REGISTRY:
            raise ValueError(f"unknown connector {name!r}; known: {sorted(_REGISTRY)}")
        module, _, cls = _REGISTRY[name].partition(":")
        _INSTANCES[name] = getattr(importlib.import_module(module), cls)()
    return _INSTANCES[name]
