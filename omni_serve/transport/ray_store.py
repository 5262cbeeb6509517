"""Ray object store connector: payloads are ``ray.put`` by their producer; a directory actor maps keys to refs.

Why a directory: Ray has no keyed object store, and a consumer opened concurrently with its producer (the
talker's call starts before the thinker has output) must find chunks by key. The directory holds only
ObjectRefs (wrapped in a list so Ray does not resolve them), so payload bytes never pass through it.
Payloads live until freed by key or by request, or until ``OMNI_SERVE_DATA_TTL_S`` passes without a consumer.
If the producer process dies, Ray reports the object lost and ``get`` raises ``DataPlaneError``.

A payload goes into the object store encoded (``omni_serve.transport.codec``), never as the payload object:
the list ``[header, nbytes, offsets, parts]``, the JSON header plus each tensor's / byte string's bytes as a
``uint8`` numpy array. What Ray's serializer (``ray._private.serialization``, Ray 2.60) does with that, checked:
a top-level ``bytes`` object is stored raw; anything else goes through msgpack (strict types), which carries
the header (bytes), the ints and the lists itself, and hands only the numpy arrays to pickle (protocol 5,
their buffers out of band: one copy into the object store on put, read-only zero-copy views on get). A tuple
instead of the list would be handed to pickle whole. So the only pickle stream a consumer loads is the one
Ray's own serializer wrote for those arrays in a worker of this cluster (who can write objects can already run
code in the cluster); the payload's classes and structure come from the JSON header, checked like every
connector's. A get copies the parts into a fresh private area (one memcpy): the tensors it returns are views
of that area, writable and independent of the object store.
"""

from __future__ import annotations

import asyncio
import time

import ray

from omni_serve import settings
from omni_serve.transport.base import Connector, DataPlaneError, DataPlaneTimeout, in_thread
from omni_serve.transport.message_types import Payload

DIRECTORY_NAME = "omni_serve_data_directory"


@ray.remote(num_cpus=0, max_concurrency=10_000)
class DataDirectory:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.entries: dict[str, tuple[list, float]] = {}
        self.waiters: dict[str, asyncio.Event] = {}
        self.owned: set[str] = set()  # keys whose producer frees them itself after the TTL (it owns the bytes)
        self._sweeper = None

    def _ensure_sweeper(self):
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self):
        while True:
            await asyncio.sleep(min(self.ttl_s / 4, 5.0))
            now = time.monotonic()
            for key in [k for k, (_, t) in self.entries.items() if now - t > self.ttl_s and k not in self.owned]:
                self.entries.pop(key, None)

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
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                self.waiters.pop(key, None)
                return None
        entry = self.entries.pop(key, None) if take else self.entries.get(key)
        if take:
            self.owned.discard(key)
        return None if entry is None else entry[0]

    async def lookup(self, key: str):
        """The value under ``key`` now, or None (never waits)."""
        entry = self.entries.get(key)
        return None if entry is None else entry[0]

    async def free(self, key: str) -> None:
        self.entries.pop(key, None)
        self.owned.discard(key)

    async def free_prefix(self, prefix: str) -> int:
        return len(await self.take_prefix(prefix))

    async def take_prefix(self, prefix: str) -> dict:
        """Remove and return every entry whose key starts with ``prefix``."""
        out = {}
        for key in [k for k in self.entries if k.startswith(prefix)]:
            out[key] = self.entries.pop(key)[0]
            self.owned.discard(key)
        return out

    async def size(self) -> int:
        return len(self.entries)


def data_directory():
    """The cluster's data directory actor (created on first use; shared by every connector that needs one)."""
    return DataDirectory.options(
        name=DIRECTORY_NAME, namespace=settings.RAY_NAMESPACE, get_if_exists=True, lifetime="detached",
    ).remote(settings.DATA_TTL_S)


class RayObjectStoreConnector(Connector):
    name = "ray"

    def __init__(self):
        self._directory = None

    @property
    def directory(self):
        if self._directory is None:
            self._directory = data_directory()
        return self._directory

    async def put(self, key: str, payload: Payload) -> None:
        from omni_serve.transport import codec  # torch: loaded where payloads are, not where specs are checked

        enc = codec.encode(payload)
        # A list, not a tuple: Ray's msgpack (strict types) would hand a whole tuple to pickle.
        ref = ray.put([enc.header, enc.nbytes, enc.offsets, enc.views()])
        await self.directory.put.remote(key, [ref])

    async def get(self, key: str, timeout: float) -> Payload:
        from omni_serve.transport import codec

        box = await self.directory.wait.remote(key, timeout)
        if box is None:
            raise DataPlaneTimeout(f"data-plane payload {key} did not arrive within {timeout:.0f} s")
        try:
            stored = await box[0]
        except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError) as exc:
            raise DataPlaneError(f"data-plane payload {key} is lost (its producer died): {exc}") from exc
        with codec.refusing(key):
            if not isinstance(stored, (tuple, list)) or len(stored) != 4 or not isinstance(stored[0], bytes):
                raise codec.RefusedPayload("not an encoded payload")
            header, nbytes, offsets, parts = stored
            if isinstance(nbytes, int) and nbytes > codec.COPY_IN_THREAD:  # large: off the event loop
                area = await in_thread(codec.gather, nbytes, offsets, parts)
            else:
                area = codec.gather(nbytes, offsets, parts)
            return codec.decode(header, area)

    async def free(self, key: str) -> None:
        await self.directory.free.remote(key)

    async def free_request(self, request_id: str) -> None:
        await self.directory.free_prefix.remote(f"{request_id}/")

    # The directory actor sweeps its own entries and holds them: this process keeps nothing to count or free.
    def sweep(self, now: float | None = None) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self._directory = None  # the (detached) actor serves the graph's other processes
