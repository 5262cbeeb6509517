"""Data-plane connector contract: tensors move between stages by key, never inside handle arguments.

Contract:
- A backend subclasses ``Connector`` (an ``abc``): ``put(key, payload)`` stores a payload (a ``Message``) under
  a key; ``get(key, timeout)`` waits for it (``DataPlaneTimeout`` when it never comes, ``DataPlaneError`` when
  the producer is gone) and hands ownership to the caller, which ``free``s it once read; ``free_request``
  drops everything a request left behind (cancellation, errors); ``sweep`` frees what nobody read within the
  TTL, ``stats`` counts what the process holds (``/health``, leak checks), ``close`` releases the backend's
  resources (idempotent); ``expect(request_id, edge)`` is a consumer's early word that it will read a stream. Its ``Settings`` (a pydantic model, or None) is the graph spec's
  ``data_plane.<settings_section or registered name>`` section (``omni_serve.transport.config``).
- Keys are ``chunk_key(request_id, edge, index)``; ``ChunkWriter``/``read_chunks`` turn a key sequence into
  an ordered stream that ends with a payload whose ``end`` attribute is true (``omni_serve.graph.messages.
  StreamChunk``), reporting each put/get (backend, bytes, seconds) to the process' transfer observer when one
  is set (metrics).
- Which backends exist is the registry's business (``omni_serve.transport.registry``), the process' instances
  live in ``omni_serve.transport.connectors`` and ``auto`` in ``omni_serve.transport.auto``; this module
  imports none of them.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Callable, ClassVar

from pydantic import BaseModel

from omni_serve.transport.message_types import Payload

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
    """One data-plane backend, built once per process (``omni_serve.transport.connectors.get_connector``).

    Payloads are ``Message``s; the backends that encode them (``omni_serve.transport.codec``) also carry the
    plain values a message is made of (tensors, bytes, lists and dicts of them), which tests and the transport
    benchmark move directly.
    """

    name: ClassVar[str] = "abstract"  # the backend's name in logs, metrics and /health
    # Where a payload can travel: "cluster" (any node), "node" (processes of one node), "process" (in-process
    # only: the Serve builder refuses such a connector for a deployed graph).
    scope: ClassVar[str] = "cluster"
    # The model of the connector's ``data_plane`` section (a description on every field); None: it takes none.
    Settings: ClassVar[type[BaseModel] | None] = None
    # The ``data_plane`` key of that section; None: the name the connector is registered under. Connectors
    # that share one set of settings (``mooncake``, ``mooncake_store``) name the same section.
    settings_section: ClassVar[str | None] = None

    @classmethod
    def from_settings(cls, section: BaseModel | None) -> "Connector":
        """Build the connector of one process.

        Args:
            section: the connector's ``data_plane`` section, an instance of ``Settings`` (its defaults when the
                spec leaves the section out); None when ``Settings`` is None.

        Returns:
            The connector; it acquires memory, files or connections lazily, on first use.
        """
        return cls()

    @abc.abstractmethod
    async def put(self, key: str, payload: Payload) -> None:
        """Store ``payload`` under ``key`` and publish it to consumers.

        Args:
            key: a ``chunk_key``; each key is put once.
            payload: the message to deliver; the caller must not change it afterwards.
        """

    def expect(self, request_id: str, edge: str) -> None:
        """Say, before reading, that this process will read the request's stream on ``edge`` (a stage calls it for
        every edge it reads when its call starts). A connector that routes each stream by where its consumer
        runs (``nearest``) tells the producer; the default does nothing.

        Args:
            request_id: the first part of the stream's ``chunk_key``s.
            edge: the edge the stream is on.
        """

    @abc.abstractmethod
    async def get(self, key: str, timeout: float) -> Payload:
        """Wait for the payload under ``key`` and take it (exactly one ``get`` of a key gets it).

        Args:
            key: the key its producer puts (or put) it under.
            timeout: seconds to wait for it.

        Returns:
            The payload; its tensors may be views of transport memory, returned when the last of them dies.
            Raises ``DataPlaneTimeout`` when it does not arrive in time, ``DataPlaneError`` when it cannot.
        """

    @abc.abstractmethod
    async def free(self, key: str) -> None:
        """Drop the payload under ``key`` (read or not); a key with no payload is not an error.

        Args:
            key: the payload's key.
        """

    @abc.abstractmethod
    async def free_request(self, request_id: str) -> None:
        """Drop every payload of a request that this connector can reach (a cancelled or failed request).

        Args:
            request_id: the first part of the request's ``chunk_key``s.
        """

    @abc.abstractmethod
    def sweep(self, now: float | None = None) -> int | Awaitable[int]:
        """Free this process' payloads that nobody read within the TTL (``PeriodicSweep`` calls it).

        Args:
            now: the ``time.monotonic()`` to judge ages by (tests pass a later one); None: now.

        Returns:
            How many payloads it freed (or an awaitable of it, for backends whose freeing is a remote call).
        """

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters of what this process holds on this backend (0 when idle: leak checks, ``/health``).

        Returns:
            Counter name to value; empty for a backend that keeps nothing per process.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release what the connector holds: its background sweep, memory, files and connections. Payloads this
        process put and nobody read are lost, as if the process had exited. Calling it again does nothing; a
        later ``put``/``get`` acquires the resources again."""


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

    def stop(self) -> None:
        """Cancel the sweep task (from any thread; a later ``ensure`` starts a new one)."""
        task, self._task = self._task, None
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)

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


async def observed_put(connector: Connector, key: str, payload: Payload) -> None:
    """``connector.put`` reported to the transfer observer (if any)."""
    if _OBSERVER is None:
        return await connector.put(key, payload)
    start = time.perf_counter()
    await connector.put(key, payload)
    _OBSERVER(connector.name, "put", payload_nbytes(payload), time.perf_counter() - start)


async def observed_get(connector: Connector, key: str, timeout: float) -> Payload:
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

    async def write(self, payload: Payload) -> None:
        await observed_put(self.connector, chunk_key(self.request_id, self.edge, self.index), payload)
        self.index += 1


async def read_chunks(connector: Connector, request_id: str, edge: str,
                      timeout: float) -> AsyncIterator[Payload]:
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
