"""The shared-memory tree cleans up after the dead (``omni_serve.transport.shm_janitor``, no Ray): a reader killed
holding views, a producer killed with unread payloads, segments removed under a reader's mappings, and one
janitor per node."""

from __future__ import annotations

import asyncio
import gc
import multiprocessing as mp
import os
import signal
import time

import torch

from omni_serve.transport.shm import SharedMemoryConnector, tree_path
from omni_serve.transport.shm_janitor import CLAIMANT, NO_CLAIMANT, process_token, token_alive
from tests.unit.test_transport_shm import _producer, connector, shm_root  # noqa: F401 - the fixture


def run(coro):
    return asyncio.run(coro)


def _reader(root, key, ready):
    """Read ``key`` and hold the tensor (a view of the producer's segment) until killed."""
    async def main():
        c = SharedMemoryConnector(root=root, directory=None)
        out = await c.get(key, 30)
        ready.set()
        await asyncio.sleep(600)
        return out
    asyncio.run(main())


def busy(c: SharedMemoryConnector) -> list[int]:
    return [s.number for s in c.pool.segments if not s.free]


def index_files(root) -> list[str]:
    return [str(p) for p in tree_path(root).glob("keys/**/*") if p.is_file()]


def test_a_reader_killed_holding_views_has_its_segment_released_by_the_janitor(shm_root):
    async def main():
        producer = connector(shm_root, ttl_s=1)  # its sweeps of the whole tree: every 0.25 s
        await producer.put("r/e/0", {"x": torch.arange(1 << 16, dtype=torch.float32)})
        reader = spawned(_reader, shm_root, "r/e/0")
        (seg,) = producer.pool.segments
        assert seg.mm[0] == 1 and seg.mm[CLAIMANT].rstrip(b"\0").startswith(f"{reader.pid}:".encode())
        producer.sweep()  # the reader lives: its segment stays busy
        assert busy(producer) == [1]
        killed(reader)
        assert not token_alive(bytes(seg.mm[CLAIMANT]))
        time.sleep(0.3)
        producer.sweep()  # a turn of this process (the only one) to sweep the whole tree
        assert busy(producer) == []
        await producer.put("r/e/1", {"x": torch.ones(1 << 16)})
        assert [s.number for s in producer.pool.segments] == [1]  # reused, not a new segment
    run(main())


def test_a_full_pool_takes_back_what_dead_readers_held_instead_of_refusing_puts(shm_root):
    async def main():
        producer = connector(shm_root, pool_bytes=1 << 20, put_timeout_s=2)
        x = torch.zeros((1 << 20) // 4 - 64)  # one segment fills the pool
        await producer.put("r/e/0", {"x": x})
        killed(spawned(_reader, shm_root, "r/e/0"))
        await producer.put("r/e/1", {"x": x})  # no sweep ran: the put itself reclaims the dead reader's segment
        assert len(producer.pool.segments) == 1
    run(main())


def spawned(target, *args):
    """A process running ``target(*args, ready)``, returned once it has set ``ready``."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=target, args=(*args, ready))
    proc.start()
    assert ready.wait(60)
    return proc


def killed(proc) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()


def test_a_killed_producers_unread_payloads_and_markers_are_removed_past_the_ttl(shm_root):
    killed(spawned(_producer, shm_root, 3, 600))
    left = index_files(shm_root)
    assert len(left) == 4 and any(p.endswith("/producer") for p in left)  # 3 payloads and the stream's marker

    janitor = connector(shm_root, ttl_s=1)  # a sweep of the whole tree is due every 0.25 s

    def sweep():
        time.sleep(0.3)
        janitor.sweep()

    sweep()
    assert not list(tree_path(shm_root).glob("pools/*"))  # the dead pool went at once
    assert len(index_files(shm_root)) == 4  # the keys are younger than the TTL
    past = time.time() - 2
    for path in left:
        os.utime(path, (past, past))
    sweep()
    assert index_files(shm_root) == []
    for d in tree_path(shm_root).glob("keys/*/*"):
        os.utime(d, (past, past))
    for d in tree_path(shm_root).glob("keys/*"):
        os.utime(d, (past, past))
    sweep()
    assert list(tree_path(shm_root).glob("keys/*")) == []  # nothing left but the tree itself


def test_the_whole_tree_is_swept_once_per_period_by_whichever_process_gets_there(shm_root):
    a, b = connector(shm_root), connector(shm_root)
    assert a.janitor.turn(5) and not b.janitor.turn(5) and not a.janitor.turn(5)  # one sweep per period
    past = time.time() - 6
    os.utime(tree_path(shm_root) / "janitor", (past, past))
    a.close()  # a dead or idle process holds nothing: the next one due sweeps
    assert b.janitor.turn(5)


def test_a_reader_forgets_its_mappings_of_removed_segments(shm_root):
    async def main():
        producer, reader = connector(shm_root), connector(shm_root)
        await producer.put("r/e/0", {"x": torch.ones(1 << 16)})
        out = await reader.get("r/e/0", 5)
        (path,) = reader._mapped
        del out
        gc.collect()
        producer.close()  # its pool (and the segment file) removed
        assert deleted_mappings(shm_root) == [path]
        reader.sweep()
        gc.collect()
        assert reader._mapped == {} and deleted_mappings(shm_root) == []
    run(main())


def deleted_mappings(root) -> list[str]:
    """This process' mappings of deleted files in the tree at ``root`` (not those other tests left)."""
    tree = str(tree_path(root))
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[5].rsplit(" (deleted)", 1)[0].strip() for line in f
                if tree in line and line.rstrip().endswith("(deleted)")]


def test_tokens_name_one_process():
    token = process_token()
    assert len(token) == len(NO_CLAIMANT) and token_alive(token)
    assert token.startswith(f"{os.getpid()}:".encode())
    assert not token_alive(f"{os.getpid()}:1".encode())  # this pid, but not this process' start
    assert token_alive(b"garbage")  # nothing is reclaimed on a guess


def test_what_a_writer_or_reader_killed_mid_operation_left_is_removed_past_the_ttl(shm_root):
    """A writer killed between writing its index file and publishing it leaves a ``.tmp-`` file; a reader killed
    between claiming an index file and reading it leaves a ``.claimed-`` file and a segment busy with no reader's
    token. Past the TTL both files go and the segment is released."""
    async def main():
        producer = connector(shm_root, ttl_s=1)
        await producer.put("r/e/0", {"x": torch.ones(1 << 16)})
        stream = tree_path(shm_root) / "keys" / "r" / "e"
        os.rename(stream / "0", stream / ".claimed-999999-abcdef-0")  # what the dead reader did
        (stream / ".tmp-999999-abcdef-1").write_bytes(b"{}")
        os.chmod(stream / ".tmp-999999-abcdef-1", 0o600)
        assert busy(producer) == [1]
        past = time.time() - 2
        for name in (".claimed-999999-abcdef-0", ".tmp-999999-abcdef-1", "producer"):
            os.utime(stream / name, (past, past))
        time.sleep(0.3)
        producer.sweep()
        assert busy(producer) == [] and sorted(p.name for p in stream.iterdir()) == []
    run(main())
