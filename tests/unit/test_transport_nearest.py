"""The ``nearest`` connector's routing (``auto`` on a Ray cluster), without Ray: the directory and the two backends
are in-process stand-ins, the nodes are names. What the real cluster does is tested in tests/multinode."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from omni_serve.transport.base import DataPlaneError, chunk_key
from omni_serve.transport.memory import MemoryConnector
from omni_serve.transport.nearest import NearestConnector, NearestSettings


class Directory:
    """The data directory's put/wait/free_prefixes semantics, in one process."""

    def __init__(self):
        self.entries: dict = {}
        self.events: dict[str, asyncio.Event] = {}

    async def call(self, method, *args, **kwargs):
        return await getattr(self, method)(*args, **kwargs)

    def send(self, method, *args, **kwargs):
        asyncio.get_running_loop().create_task(self.call(method, *args, **kwargs))

    async def put(self, key, value, owned=False):
        self.entries[key] = value
        self.events.setdefault(key, asyncio.Event()).set()

    async def wait(self, key, timeout, take=False):
        if key not in self.entries:
            try:
                await asyncio.wait_for(self.events.setdefault(key, asyncio.Event()).wait(), timeout)
            except asyncio.TimeoutError:
                return None
        return self.entries.pop(key) if take else self.entries[key]

    async def free_prefixes(self, prefixes):
        for key in [k for k in self.entries if k.startswith(tuple(prefixes))]:
            del self.entries[key]


class Backends:
    """One shared-memory stand-in per node (a payload put there is readable only on that node) and one remote."""

    def __init__(self):
        self.shm: dict[str, MemoryConnector] = {}
        self.remote = MemoryConnector()
        self.freed: list[tuple[str, str]] = []

    def of(self, node: str):
        def backend(name):
            if name == "shm":
                return self.shm.setdefault(node, MemoryConnector())
            assert name == "mooncake"
            return self.remote
        return backend


def endpoint(monkeypatch, directory, backends, node: str, nodes: int = 2, wait_s: float = 2.0) -> NearestConnector:
    c = NearestConnector(NearestSettings(remote="mooncake", route_wait_s=wait_s))
    c._where = {"node": node, "ip": f"ip-{node}"}
    c._remote, c._local_ok = "mooncake", True
    c._nodes = (float("inf"), nodes)  # the cluster's alive nodes, never looked up again
    monkeypatch.setattr(c, "_directory", lambda: directory)
    monkeypatch.setattr(c, "_backend", backends.of(node))
    return c


@pytest.fixture
def world(monkeypatch):
    directory, backends = Directory(), Backends()
    return lambda node, **kw: endpoint(monkeypatch, directory, backends, node, **kw), directory, backends


def run(coro):
    return asyncio.run(coro)


def test_a_consumer_on_the_producers_node_reads_over_shared_memory(world):
    make, directory, backends = world
    producer, consumer = make("a"), make("a")

    async def main():
        consumer.expect("r", "e")  # its call started
        await asyncio.sleep(0)
        await producer.put(chunk_key("r", "e", 0), {"t": torch.arange(3)})
        await producer.put(chunk_key("r", "e", 1), {"t": torch.arange(4)})
        assert (await consumer.get(chunk_key("r", "e", 0), 5))["t"].tolist() == [0, 1, 2]
        assert (await consumer.get(chunk_key("r", "e", 1), 5))["t"].tolist() == [0, 1, 2, 3]
    run(main())
    assert producer.stats() == {"streams_shm": 1} and consumer.stats() == {"streams_shm": 1}
    route = consumer.recent[-1]
    assert route["backend"] == "shm" and route["producer"]["ip"] == route["reader"]["ip"] == "ip-a"
    assert not backends.remote.stats().get("unread")


def test_a_consumer_on_another_node_reads_over_the_remote_connector(world):
    make, directory, backends = world
    producer, consumer = make("a"), make("b")

    async def main():
        reader = asyncio.ensure_future(consumer.get(chunk_key("r", "e", 0), 5))  # waits before the producer puts
        await asyncio.sleep(0.01)
        await producer.put(chunk_key("r", "e", 0), {"x": 1})
        assert (await reader) == {"x": 1}
    run(main())
    assert producer.recent[-1]["backend"] == "mooncake"
    assert producer.recent[-1]["reader"]["node"] == "b" and "a" not in backends.shm


def test_a_reader_that_never_says_where_it_runs_gets_the_remote_route(world):
    make, directory, backends = world
    producer = make("a", wait_s=0.05)

    async def main():
        t0 = time.monotonic()
        await producer.put(chunk_key("r", "e", 0), {"x": 1})
        return time.monotonic() - t0
    assert run(main()) >= 0.05
    assert producer.recent[-1]["backend"] == "mooncake" and producer.recent[-1]["reader"] is None


def test_a_one_node_cluster_routes_over_shared_memory_without_waiting_for_the_reader(world):
    make, directory, backends = world
    producer = make("a", nodes=1, wait_s=60)

    async def main():
        await asyncio.wait_for(producer.put(chunk_key("r", "e", 0), {"x": 1}), 5)
    run(main())
    assert producer.recent[-1]["backend"] == "shm"


def test_a_shared_memory_route_read_on_another_node_fails_at_once(world):
    """A consumer that moved between the producer's look and its read: an error naming both nodes, never a wait."""
    make, directory, backends = world
    producer, consumer = make("a", nodes=1), make("b")

    async def main():
        await producer.put(chunk_key("r", "e", 0), {"x": 1})
        t0 = time.monotonic()
        with pytest.raises(DataPlaneError, match="shared memory on node a.*runs on node b"):
            await consumer.get(chunk_key("r", "e", 0), 30)
        assert time.monotonic() - t0 < 5
    run(main())


def test_free_request_drops_the_routes_and_frees_both_backends(world):
    make, directory, backends = world
    producer, consumer = make("a"), make("b")

    async def main():
        consumer.expect("r", "e")
        await asyncio.sleep(0)
        await producer.put(chunk_key("r", "e", 0), {"t": torch.ones(2)})
        assert any(k.startswith("@route/r/") for k in directory.entries)
        await consumer.free_request("r")
        assert not [k for k in directory.entries if k.startswith(("@route/r/", "@reader/r/"))]
        assert not backends.remote.stats().get("unread")
    run(main())
