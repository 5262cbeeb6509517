"""The ``nearest`` connector: per stream, shared memory when its consumer runs on the producer's node, else a
connector that reaches any node. What ``auto`` is on a Ray cluster (``omni_serve.transport.auto``).

Contract:
- A stream is one request's payloads on one edge (``chunk_key``'s first two parts); its route is chosen once, at
  its producer's first put, and published in the data directory (``omni_serve.transport.directory``) under
  ``@route/<request>/<edge>``: ``{"backend", "producer": {node, ip}, "reader": {node, ip} or None}``.
- The consumer says where it runs under ``@reader/<request>/<edge>``: when its stage call starts (``expect``,
  called for every edge the stage reads) or at its first ``get``. The producer waits up to
  ``data_plane.nearest.route_wait_s`` for it: same node (and shared memory usable there) -> ``shm``, else the
  ``remote`` connector (``mooncake`` when its module loads, else ``ray``). A cluster with one alive node routes
  over shared memory at once, without waiting. A reader that never said where it runs gets the remote route,
  which is correct anywhere.
- The consumer's first ``get`` of a stream waits for the route, then reads through that backend; a stream routed
  over shared memory to another node fails at once with a ``DataPlaneError`` (a replica moved between the two
  looks), never waits out its timeout.
- Each backend is the process' own instance (``omni_serve.transport.connectors``), so its memory, sweeps and
  counters are shared with edges that name it directly. ``free_request`` frees the request on both backends
  and drops its route entries; this connector holds no payload itself (``stats`` counts the routes it chose).
- Routes are cached per process (``ROUTE_CACHE`` streams, least recently used dropped first).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.transport.base import Connector, DataPlaneError, DataPlaneTimeout, split_key
from omni_serve.transport.message_types import Payload

ROUTE_CACHE = 4096
NODE_COUNT_TTL_S = 2.0  # how long a look at the cluster's alive nodes is trusted
LOCAL = "shm"


class NearestSettings(BaseModel):
    """``data_plane.nearest``: how the ``nearest`` connector (``auto`` on a Ray cluster) routes streams."""

    model_config = ConfigDict(extra="forbid")

    remote: str = Field("auto", description=(
        "Connector for streams whose consumer runs on another node: 'mooncake', 'ray', 'mooncake_store' or a "
        "plug-in of cluster scope; 'auto': mooncake when its module loads on this node, else ray."))
    route_wait_s: float = Field(2.0, ge=0, description=(
        "How long a producer's first put of a stream waits for its consumer to say which node it runs on (a "
        "consumer says so when its stage call starts). Past it the stream takes the remote connector: correct "
        "anywhere, slower than shared memory between two stages of one node."))


def _here() -> dict[str, str]:
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


class NearestConnector(Connector):
    name = "nearest"
    Settings = NearestSettings

    def __init__(self, section: NearestSettings | None = None, data_plane: Any = None):
        self.settings = section or NearestSettings()
        self.data_plane = data_plane
        self._routes: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._choosing: dict[tuple[str, str], asyncio.Future] = {}
        self._expected: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._where: dict[str, str] | None = None
        self._nodes: tuple[float, int] = (0.0, 0)
        self._remote: str | None = None
        self._local_ok: bool | None = None
        self.counts: Counter = Counter()
        self.recent: deque = deque(maxlen=64)  # the last routes chosen or read here (tests, operators)

    @classmethod
    def from_data_plane(cls, data_plane) -> "NearestConnector":
        """Built with the whole ``data_plane``: its backends are built from their own sections."""
        return cls(data_plane.section("nearest"), data_plane)

    # -- backends -----------------------------------------------------------------------------------------
    def _backend(self, name: str) -> Connector:
        from omni_serve.transport.connectors import get_connector

        return get_connector(name, self.data_plane)

    @property
    def remote(self) -> str:
        if self._remote is None:
            from omni_serve.transport.auto import mooncake_loads
            from omni_serve.transport.registry import connector_class

            name = self.settings.remote
            if name == "auto":
                name = "mooncake" if mooncake_loads() else "ray"
            if name == self.name or connector_class(name).scope != "cluster":
                raise ValueError(f"data_plane.nearest.remote: {name!r} does not reach other nodes")
            self._remote = name
        return self._remote

    def _local_usable(self) -> bool:
        if self._local_ok is None:
            from omni_serve.transport.auto import shm_dir, shm_usable

            self._local_ok = shm_usable(shm_dir(self.data_plane))[0]
        return self._local_ok

    def _known(self, name: str) -> bool:
        return name in (LOCAL, self.remote)

    # -- where things run ---------------------------------------------------------------------------------
    @property
    def here(self) -> dict[str, str]:
        if self._where is None:
            self._where = _here()
        return self._where

    async def _alive_nodes(self) -> int:
        checked, count = self._nodes
        if time.monotonic() - checked > NODE_COUNT_TTL_S:
            from omni_serve.transport.auto import alive_nodes

            count = await asyncio.to_thread(alive_nodes) or 1  # a GCS call: off the event loop
            self._nodes = (time.monotonic(), count)
        return count

    @staticmethod
    def _directory():
        from omni_serve.transport.directory import directory

        return directory()

    def _remember(self, stream: tuple[str, str], route: str, info: dict[str, Any], side: str) -> None:
        self._routes[stream] = route
        self._routes.move_to_end(stream)
        while len(self._routes) > ROUTE_CACHE:
            self._routes.popitem(last=False)
        self.counts[route] += 1
        self.recent.append({"edge": stream[1], "backend": route, "side": side,
                            "producer": info.get("producer"), "reader": info.get("reader")})

    # -- producer -----------------------------------------------------------------------------------------
    async def put(self, key: str, payload: Payload) -> None:
        parts = split_key(key)
        route = self.remote if parts is None else await self._route_for_put((parts[0], parts[1]))
        await self._backend(route).put(key, payload)

    async def _route_for_put(self, stream: tuple[str, str]) -> str:
        route = self._routes.get(stream)
        if route is not None:
            return route
        pending = self._choosing.get(stream)
        if pending is None:  # the first put of the stream chooses; concurrent ones wait for its choice
            pending = self._choosing[stream] = asyncio.ensure_future(self._choose(stream))
            pending.add_done_callback(lambda _: self._choosing.pop(stream, None))
        return await asyncio.shield(pending)

    async def _choose(self, stream: tuple[str, str]) -> str:
        rid, edge = stream
        client = self._directory()
        reader = None
        if await self._alive_nodes() > 1 or not self._local_usable():
            reader = await client.call("wait", f"@reader/{rid}/{edge}", self.settings.route_wait_s)
            local = reader is not None and reader.get("node") == self.here["node"] and self._local_usable()
        else:
            local = True  # one node: wherever the reader runs, it is here
        route = LOCAL if local else self.remote
        info = {"backend": route, "producer": self.here, "reader": reader}
        await client.call("put", f"@route/{rid}/{edge}", info)
        self._remember(stream, route, info, "put")
        return route

    # -- consumer -----------------------------------------------------------------------------------------
    def expect(self, request_id: str, edge: str) -> None:
        stream = (request_id, edge)
        if stream in self._expected:
            return
        self._expected[stream] = None
        while len(self._expected) > ROUTE_CACHE:
            self._expected.popitem(last=False)
        self._directory().send("put", f"@reader/{request_id}/{edge}", self.here)

    async def get(self, key: str, timeout: float) -> Payload:
        parts = split_key(key)
        if parts is None:
            return await self._backend(self.remote).get(key, timeout)
        stream = (parts[0], parts[1])
        route = self._routes.get(stream)
        if route is None:
            start = time.monotonic()
            self.expect(*stream)
            info = await self._directory().call("wait", f"@route/{stream[0]}/{stream[1]}", timeout)
            if info is None:
                raise DataPlaneTimeout(f"data-plane payload {key} did not arrive within {timeout:.0f} s "
                                       "(its producer never chose a route)")
            route = info.get("backend")
            if not isinstance(route, str) or not self._known(route):
                raise DataPlaneError(f"data-plane payload {key}: its producer routed it over {route!r}, which "
                                     f"this process does not use ({LOCAL}, {self.remote})")
            producer_node = (info.get("producer") or {}).get("node")
            if route == LOCAL and producer_node != self.here["node"]:
                raise DataPlaneError(f"data-plane payload {key} is in shared memory on node {producer_node}, but "
                                     f"its consumer runs on node {self.here['node']} (it moved between the two)")
            self._remember(stream, route, {**info, "reader": self.here}, "get")  # the reader is this process
            timeout = max(timeout - (time.monotonic() - start), 0.001)
        return await self._backend(route).get(key, timeout)

    # -- freeing ------------------------------------------------------------------------------------------
    async def free(self, key: str) -> None:
        parts = split_key(key)
        route = None if parts is None else self._routes.get((parts[0], parts[1]))
        for name in ([route] if route else [LOCAL, self.remote]):
            await self._backend(name).free(key)

    async def free_request(self, request_id: str) -> None:
        errors = []
        for name in (LOCAL, self.remote):
            try:
                await self._backend(name).free_request(request_id)
            except Exception as exc:  # noqa: BLE001 - free on the other backend all the same
                errors.append(exc)
        await self._directory().call("free_prefixes", [f"@route/{request_id}/", f"@reader/{request_id}/"])
        for stream in [s for s in self._routes if s[0] == request_id]:
            del self._routes[stream]
        if errors:
            raise errors[0]

    def sweep(self, now: float | None = None) -> int:
        return 0  # its backends sweep what they hold; the directory sweeps route entries

    def stats(self) -> dict[str, int]:
        """Streams routed by this process so far, per backend (``streams_shm``, ``streams_mooncake``...)."""
        return {f"streams_{name}": n for name, n in self.counts.items()}

    def close(self) -> None:
        self._routes.clear()
        self._expected.clear()
