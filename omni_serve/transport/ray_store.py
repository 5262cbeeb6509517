"""Ray object store connector: payloads are ``ray.put`` by their producer; the data directory maps keys to refs.

Why a directory (``omni_serve.transport.directory``): Ray has no keyed object store, and a consumer opened
concurrently with its producer (the talker's call starts before the thinker has output) must find chunks by key.
The directory holds only ObjectRefs (wrapped in a list so Ray does not resolve them), so payload bytes never pass through it.
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

import ray

from omni_serve.transport.base import Connector, DataPlaneError, DataPlaneTimeout, in_thread
from omni_serve.transport.directory import directory
from omni_serve.transport.message_types import Payload

class RayObjectStoreConnector(Connector):
    name = "ray"

    @property
    def directory(self):
        return directory()

    async def put(self, key: str, payload: Payload) -> None:
        from omni_serve.transport import codec  # torch: loaded where payloads are, not where specs are checked

        enc = codec.encode(payload)
        # A list, not a tuple: Ray's msgpack (strict types) would hand a whole tuple to pickle.
        ref = ray.put([enc.header, enc.nbytes, enc.offsets, enc.views()])
        await self.directory.call("put", key, [ref])

    async def get(self, key: str, timeout: float) -> Payload:
        from omni_serve.transport import codec

        box = await self.directory.call("wait", key, timeout)
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
        await self.directory.call("free", key)

    async def free_request(self, request_id: str) -> None:
        await self.directory.call("free_prefix", f"{request_id}/")

    # The directory actor sweeps its own entries and holds them: this process keeps nothing to count or free.
    def sweep(self, now: float | None = None) -> int:
        return 0

    def stats(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass  # the (detached) directory actor serves the graph's other processes
