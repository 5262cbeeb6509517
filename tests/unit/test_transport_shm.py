"""Shared-memory connector and payload codec: round trips, zero-copy, freeing, TTL, faults (no Ray)."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

from omni_serve.transport import codec
from omni_serve.transport.base import DataPlaneError, DataPlaneTimeout, chunk_key, split_key
from omni_serve.transport.shm import POLL_FAST_S, POLL_FIRST_S, POLL_MAX_S, SharedMemoryConnector, poll_delay, tree_path


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def shm_root(tmp_path):
    return tmp_path / "shm"


def connector(root, **kw) -> SharedMemoryConnector:
    return SharedMemoryConnector(root=root, directory=kw.pop("directory", None), **kw)


def mapped_range(mm) -> tuple[int, int]:
    """[start, end) addresses of an mmap in this process."""
    view = np.frombuffer(mm, dtype=np.uint8)
    start = view.ctypes.data
    del view  # releases the export (the connector may close the map later)
    return start, start + len(mm)


def inside(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether all of ``t``'s bytes lie in one of the address ranges."""
    return any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in ranges)


def segments_on_disk(root) -> list[str]:
    return sorted(str(p) for p in (tree_path(root) / "pools").glob("*/seg.*"))


def index_files(root) -> list[str]:
    return sorted(str(p) for p in (tree_path(root) / "keys").rglob("*") if p.is_file())


# -- codec --------------------------------------------------------------------------------------------------
def test_codec_round_trip_keeps_structure_dtypes_and_views():
    x = torch.arange(24, dtype=torch.float32).view(4, 6)
    payload = {"a": x[:, 1:3], "b": [x.bfloat16(), {"c": torch.tensor([1, 2], dtype=torch.int64)}],
               "n": 3, "s": "text", "none": None, "empty": torch.empty(0, 5), "flag": torch.tensor(True)}
    enc = codec.encode(payload)
    assert all(o % codec.ALIGN == 0 for o in enc.offsets)
    area = bytearray(enc.nbytes)
    enc.write_into(area)
    out = codec.decode(enc.header, memoryview(area))
    assert torch.equal(out["a"], x[:, 1:3]) and out["a"].is_contiguous()
    assert out["b"][0].dtype == torch.bfloat16 and torch.equal(out["b"][0], x.bfloat16())
    assert torch.equal(out["b"][1]["c"], torch.tensor([1, 2]))
    assert out["n"] == 3 and out["s"] == "text" and out["none"] is None
    assert out["empty"].shape == (0, 5) and bool(out["flag"])
    # zero-copy: the decoded tensor is a view of the area
    area[enc.offsets[0]:enc.offsets[0] + 4] = torch.tensor([99.0]).numpy().tobytes()
    assert out["a"].flatten()[0] == 99.0
    # a view of a big tensor carries only its own bytes
    assert codec.encode({"v": torch.zeros(1 << 20)[:4]}).nbytes == codec.ALIGN


def test_split_key_inverts_chunk_key():
    assert split_key(chunk_key("req-1", "thinker_talker", 12)) == ("req-1", "thinker_talker", 12)
    assert split_key("no-index/edge") is None and split_key("plain") is None


# -- shm, one process ---------------------------------------------------------------------------------------
def test_put_get_free_and_segment_reuse(shm_root):
    async def main():
        c = connector(shm_root)
        x = torch.randn(300, 70)
        await c.put("r1/e/0", {"x": x, "codes": [1, 2, 3], "end": True})
        out = await c.get("r1/e/0", 5)
        assert torch.equal(out["x"], x) and out["codes"] == [1, 2, 3] and out["end"] is True
        assert c.stats()["busy_segments"] == 1  # the tensor still views the segment
        del out
        gc.collect()
        assert c.stats()["busy_segments"] == 0
        for i in range(1, 20):  # reused, not grown
            await c.put(f"r1/e/{i}", {"x": x})
            del (await c.get(f"r1/e/{i}", 5))["x"]
        assert c.stats()["segments"] == 1
        assert index_files(shm_root) == [str(tree_path(shm_root) / "keys/r1/e/producer")]
        await c.free_request("r1")
        assert index_files(shm_root) == []
    run(main())


def test_free_request_releases_unread_payloads(shm_root):
    async def main():
        c = connector(shm_root)
        for i in range(3):
            await c.put(f"gone/a.b/{i}", {"x": torch.ones(1000)})
        await c.put("gone/c.d/0", {"x": torch.ones(10)})
        await c.put("kept/a.b/0", {"x": torch.ones(10)})
        assert c.stats()["busy_segments"] == 5
        await c.free_request("gone")
        assert c.stats()["busy_segments"] == 1
        assert not (tree_path(shm_root) / "keys/gone").exists()
        with pytest.raises(DataPlaneTimeout):
            await c.get("gone/a.b/0", 0.05)
        assert torch.equal((await c.get("kept/a.b/0", 1))["x"], torch.ones(10))
    run(main())


def test_unread_payload_is_freed_after_ttl(shm_root):
    async def main():
        c = connector(shm_root, ttl_s=30)
        await c.put("r/e/0", {"x": torch.ones(100)})
        assert c.sweep() == 0 and c.stats()["busy_segments"] == 1
        assert c.sweep(now=time.monotonic() + 31) == 1
        assert c.stats() == {"segments": 1, "pool_bytes": c.stats()["pool_bytes"], "busy_segments": 0,
                             "unread": 0}
        with pytest.raises(DataPlaneTimeout):
            await c.get("r/e/0", 0.05)
    run(main())


def test_a_waiting_get_looks_often_at_first_and_seldom_after_a_long_wait():
    delay, waited, looks = POLL_FIRST_S, 0.0, []
    while waited < 5.0:
        waited += delay
        delay = poll_delay(delay, waited)
        looks.append((waited, delay))
    early = [d for w, d in looks if w < 0.05]
    assert max(early) == POLL_FAST_S  # a payload that comes soon is seen within 2 ms
    assert all(d <= max(POLL_FAST_S, 0.02 * w) + 1e-12 for w, d in looks)  # never more than 2% of the wait
    assert looks[-1][1] == POLL_MAX_S and sum(1 for w, _ in looks if w > 2.0) < 200  # ~50 looks a second late on


def test_get_waits_for_a_late_producer(shm_root):
    async def main():
        c = connector(shm_root)

        async def late():
            await asyncio.sleep(0.1)
            await c.put("r/e/0", {"v": torch.tensor([7])})
        task = asyncio.create_task(late())
        out = await c.get("r/e/0", 5)
        await task
        return int(out["v"])
    assert run(main()) == 7


def test_full_pool_reports_a_clear_error(shm_root):
    async def main():
        c = connector(shm_root, pool_bytes=1 << 20, put_timeout_s=0.2)
        await c.put("r/e/0", {"x": torch.zeros(200_000)})  # 800 KB: one 1 MiB segment, never read
        with pytest.raises(DataPlaneError, match="pool full"):
            await c.put("r/e/1", {"x": torch.zeros(200_000)})
    run(main())


def test_full_tmpfs_fails_the_put_clearly_instead_of_a_sigbus(shm_root, monkeypatch):
    """A segment's pages are reserved when it is made: a tmpfs without room (ENOSPC) fails that put with a clear
    error and leaves no file behind, and the connector keeps working once there is room."""
    import errno

    real = os.posix_fallocate

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    async def main():
        c = connector(shm_root)
        monkeypatch.setattr(os, "posix_fallocate", no_space)
        with pytest.raises(DataPlaneError, match="cannot reserve a .*No space left"):
            await c.put("r/e/0", {"x": torch.zeros(1000)})
        assert segments_on_disk(shm_root) == [] and index_files(shm_root) == []
        monkeypatch.setattr(os, "posix_fallocate", real)
        await c.put("r/e/0", {"x": torch.ones(1000)})
        assert torch.equal((await c.get("r/e/0", 5))["x"], torch.ones(1000))
    run(main())


def test_cross_node_consumer_gets_a_clear_error(shm_root):
    class FakeDirectory:
        def announce(self, rid, edge, node):
            raise AssertionError("not the producer here")

        async def node_of(self, rid, edge):
            return "another-node"

        def forget(self, rid):
            pass

    async def main():
        c = connector(shm_root, directory=FakeDirectory())
        t0 = time.monotonic()
        with pytest.raises(DataPlaneError, match="another-node.*use connector 'mooncake' or 'ray'"):
            await c.get("r/thinker_talker/0", 30)
        assert time.monotonic() - t0 < 5
    run(main())


# -- shm, across processes ----------------------------------------------------------------------------------
def _producer(root, n, hold_s, ready):
    async def main():
        c = connector(root)
        for i in range(n):
            await c.put(f"x/p.c/{i}", {"t": torch.full((1 << 18,), float(i)), "i": i})
        ready.set()
        await asyncio.sleep(hold_s)
    asyncio.run(main())


def test_other_process_reads_zero_copy_and_returns_segments(shm_root):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_producer, args=(shm_root, 3, 60, ready))
    proc.start()
    try:
        assert ready.wait(60)

        async def main():
            c = connector(shm_root)
            outs = [await c.get(f"x/p.c/{i}", 5) for i in range(3)]
            assert [o["i"] for o in outs] == [0, 1, 2]
            assert all(float(o["t"][-1]) == i for i, o in enumerate(outs))
            # zero-copy: each tensor's bytes lie inside a segment this process mapped, not in a private copy
            ranges = [mapped_range(mm) for mm in c._mapped.values()]
            assert all(inside(o["t"], ranges) for o in outs), ([o["t"].data_ptr() for o in outs], ranges)
            assert all(mm[0] == 1 for mm in c._mapped.values())  # busy while the views live
            del outs
            gc.collect()
            assert all(mm[0] == 0 for mm in c._mapped.values())
        run(main())
    finally:
        proc.kill()
        proc.join()


def _producer_that_exits(root, done):
    async def main():
        c = connector(root)
        await c.put("x/p.c/0", {"t": torch.ones(16)})
        await c.put("x/p.c/1", {"t": torch.ones(16)})
        done.wait(60)  # the consumer read chunk 0; chunk 1 stays unread, the request is never freed here
    asyncio.run(main())


def test_a_producer_that_exits_leaves_nothing_in_the_tree_without_a_janitor(shm_root):
    """A replica that leaves a node (a redeploy moved its stage) where no other process sweeps: its exit removes
    its pool, its stream markers and its unread payloads' index files, though nobody freed the request."""
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=_producer_that_exits, args=(shm_root, done))
    proc.start()

    async def main():
        c = connector(shm_root)
        assert (await c.get("x/p.c/0", 30))["t"].sum() == 16
    run(main())
    assert any(p.endswith("/producer") for p in index_files(shm_root)), index_files(shm_root)
    done.set()
    proc.join(60)
    assert proc.exitcode == 0
    assert index_files(shm_root) == []
    assert segments_on_disk(shm_root) == []
    assert not (tree_path(shm_root) / "keys/x").exists()


def test_killed_producer_fails_the_waiting_consumer_and_its_pool_is_collected(shm_root):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_producer, args=(shm_root, 1, 60, ready))
    proc.start()
    assert ready.wait(60)
    assert segments_on_disk(shm_root)

    async def main():
        c = connector(shm_root)
        waiter = asyncio.create_task(c.get("x/p.c/1", 30))  # chunk 1 will never come
        await asyncio.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        t0 = time.monotonic()
        with pytest.raises(DataPlaneError, match="producer process died"):
            await waiter
        assert time.monotonic() - t0 < 3
        assert c.collect_dead_pools() == 1
        assert segments_on_disk(shm_root) == []
        with pytest.raises(DataPlaneError, match="producer process died"):
            await c.get("x/p.c/0", 1)  # published before the kill: its memory went with the pool
    run(main())


def test_payload_without_tensors_needs_no_segment_and_still_expires(shm_root):
    async def main():
        c = connector(shm_root, ttl_s=30)
        await c.put("r/talker_code2wav/0", {"codes": [5, 6, 7], "end": False})
        assert (await c.get("r/talker_code2wav/0", 1)) == {"codes": [5, 6, 7], "end": False}
        await c.put("r/talker_code2wav/1", {"codes": [], "end": True})  # never read
        assert c.stats()["segments"] == 0 and c.stats()["unread"] == 1
        assert c.sweep(now=time.monotonic() + 31) == 1 and c.stats()["unread"] == 0
    run(main())
