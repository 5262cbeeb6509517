"""Same-node shared-memory connector: pooled tmpfs segments, zero-copy reads, no Ray call per chunk.

Layout under ``<OMNI_SERVE_SHM_DIR>/omni_serve.<uid>.<namespace>/`` (a tmpfs, ``/dev/shm`` by default; the
*tree*, private to the serving user, see "Trust boundary" below):

- ``pools/<pool>/lock`` + ``pools/<pool>/seg.<n>``: one pool per producing process. The process holds an
  ``flock`` on ``lock`` for its lifetime, so any process can tell a dead pool (the lock is free) and
  remove it. A segment's first byte is its state (0 free, 1 busy); the payload's tensors follow.
- ``keys/<request>/<edge>/<index>``: an *index file* per payload, published by atomic rename: one JSON
  document ``{"v": 1, "pool": <pool>, "seg": <n>, "nbytes": <n>, "payload": <codec header>}`` (pool and
  seg null when the payload has no tensor or byte string; the header: ``omni_serve.transport.codec``, JSON,
  never pickle).
  ``keys/<request>/<edge>/producer`` names the pool producing that stream.

Protocol:
- ``put`` copies the payload's tensors into a free segment of the producer's pool (one memcpy; a new
  segment only when none fits: fresh tmpfs pages cost ~8x a copy into touched ones), then publishes the
  index file. No Ray call, no pickling.
- ``get`` *claims* the index file by renaming it (atomic, so exactly one party wins: the consumer, the TTL
  sweeper or ``free_request``), maps the segment once per process and returns tensors that are views of
  it (zero-copy). The segment goes back to its pool (state byte 0) when the last of those tensors dies.
- ``free_request`` claims and releases everything a request left behind on this node. Unclaimed payloads
  older than ``OMNI_SERVE_DATA_TTL_S`` are released by their producer's sweeper, or by the node's janitor when
  the producer died (``omni_serve.transport.shm_janitor``); a reader writes its process token into the
  segment's header when it claims it, so a segment whose reader died holding views is released too.
- Producer gone: while a consumer waits, it checks the stream's pool lock and raises ``DataPlaneError``
  once the producer process is dead. Another node: the producer announces its node id for each stream
  in the Ray data directory (when Ray is up); a consumer on another node gets a ``DataPlaneError`` saying
  the edge needs another connector, instead of waiting out its timeout.

Trust boundary (the file-system primitives: ``omni_serve.transport.shm_tree``): only the serving user (the
effective uid, part of the tree's name) can read or write the tree. Every connector start creates it ``0700`` or verifies the existing one (``UnsafeSharedMemory``,
naming the path and the fault, when it is a symlink, not a directory, owned by another uid, or open to group
or others; likewise ``pools`` and ``keys``, and a parent directory others could replace it in). Files are
created ``0600`` with ``O_EXCL`` (index files and markers under a unique name, then renamed into place) and
opened with ``O_NOFOLLOW``; what is read must be a regular file of ours. An index file names its segment by
pool id and number only (checked, resolved inside the tree), and its bytes are parsed as JSON, so a planted
file can at worst be refused (``RefusedPayload``): it cannot run code, nor point a reader at a file outside
the tree.

Why not ``multiprocessing.shared_memory``: its resource tracker unlinks segments when the creating
process exits and warns about segments other processes still use; plain files in tmpfs give atomic
rename (the claim) and ``flock`` (liveness) for free.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import mmap
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omni_serve import settings
from omni_serve.transport import codec
from omni_serve.transport.base import (
    Connector, DataPlaneError, DataPlaneTimeout, PeriodicSweep, split_key,
)
from omni_serve.transport.codec import RefusedPayload
from omni_serve.transport.message_types import Payload
from omni_serve.transport.shm_janitor import (
    BUSY, CLAIMANT, FREE, NO_CLAIMANT, Janitor, pool_alive as _pool_alive, process_token, reclaim_dead_claims,
    release as _release, unmap_unlinked,
)
from omni_serve.transport.shm_tree import (  # noqa: F401 - UnsafeSharedMemory and tree_path are part of this API
    CREATE, OPEN, UnsafeSharedMemory, idle as _idle, mkdir_private as _mkdir_private, name_part as _name,
    open_ours as _open_ours, open_private_tree, read_ours as _read_ours, remove as _remove, rmdir_quiet as _rmdir,
    subdirs as _subdirs, tree_path, write_new as _write_new,
)

log = logging.getLogger(__name__)

HEADER = 64  # bytes before a segment's payload area (byte 0: state; bytes 8-40: its reader, shm_janitor.CLAIMANT)
MIN_SEGMENT = 64 << 10
LIVENESS_PERIOD_S = 0.25
JANITOR_PERIOD_S = 5.0  # the whole tree is swept this often by one of the processes using it
NODE_CHECK_PERIOD_S = 2.0  # a waiting get asks the cluster-wide directory where its producer runs this often
MAPPED_SEGMENTS = 1024  # segments a process keeps mapped (LRU) for reading
INDEX_FORMAT = 1
INDEX_KEYS = {"v", "pool", "seg", "nbytes", "payload"}
POOL_ID = re.compile(r"[0-9]{1,10}-[0-9a-f]{8}")  # f"{pid}-{8 hex}": ids read from files must match
POLL_FIRST_S = 0.0002  # a waiting get looks again after 0.2 ms, then backs off (poll_delay)
POLL_FAST_S = 0.002  # ... doubling up to 2 ms
POLL_SHARE = 0.02  # ... and, once it has waited long, to 2% of the time it has waited
POLL_MAX_S = 0.02  # ... never more than 20 ms


def poll_delay(delay: float, waited: float) -> float:
    """The next pause of a get waiting for its payload. Each look is a failed rename plus an event-loop wake-up
    (~25 us); at 2 ms, eight waiting streams cost a tenth of a core. A get that has waited long looks less often:
    at most 2% of the wait so far (20 ms at most) is added to its latency."""
    if delay < POLL_FAST_S:
        return min(delay * 2, POLL_FAST_S)
    return min(max(POLL_FAST_S, POLL_SHARE * waited), POLL_MAX_S)


def _size_class(nbytes: int) -> int:
    """Segment size for a payload: its size rounded up to a quarter of its power of two (<= 25% waste)."""
    need = max(nbytes + HEADER, MIN_SEGMENT)
    granule = 1 << max(need.bit_length() - 3, 12)
    return -(-need // granule) * granule


@dataclass
class _Segment:
    path: str
    number: int
    size: int
    mm: mmap.mmap

    @property
    def free(self) -> bool:
        return self.mm[0] == FREE


class _Pool:
    """The producing side of one process: its segments, its lock, the keys it published."""

    def __init__(self, root: Path, limit_bytes: int):
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging = root / "pools" / f".new-{self.id}"
        os.mkdir(staging, 0o700)
        self.lock_fd = os.open(staging / "lock", CREATE | os.O_RDWR, 0o600)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        self.dir = root / "pools" / self.id
        os.rename(staging, self.dir)  # appears with its lock held: never mistaken for a dead pool
        self.limit = limit_bytes
        self.segments: list[_Segment] = []
        self.counter = 0
        self.lock = threading.Lock()
        self.published: dict[str, tuple[str, float]] = {}  # index path -> (segment path, put time)
        self.streams: dict[str, float] = {}  # producer marker path -> time

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.segments)

    def acquire(self, nbytes: int) -> _Segment | None:
        size = _size_class(nbytes)
        with self.lock:
            fits = [s for s in self.segments if s.size >= nbytes + HEADER and s.size <= 2 * size and s.free]
            if fits:
                seg = min(fits, key=lambda s: s.size)
            else:
                while self.nbytes + size > self.limit:
                    idle = [s for s in self.segments if s.free]
                    if not idle:
                        return None
                    self._drop(max(idle, key=lambda s: s.size))
                seg = self._create(size)
            seg.mm[0] = BUSY
            seg.mm[CLAIMANT] = NO_CLAIMANT  # read by nobody yet
            return seg

    def _create(self, size: int) -> _Segment:
        self.counter += 1
        path = str(self.dir / f"seg.{self.counter}")
        fd = os.open(path, CREATE | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            # Reserve the pages now: a full tmpfs then fails this call (ENOSPC) instead of killing the process
            # with SIGBUS when the copy touches a page that cannot be allocated (a container's /dev/shm is often
            # only 64 MiB).
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise DataPlaneError(f"shared memory: cannot reserve a {size}-byte segment in {self.dir} ({exc}); "
                                 f"give the node a larger tmpfs (data_plane.shm.dir / OMNI_SERVE_SHM_DIR) or use "
                                 f"another connector for this edge") from exc
        else:
            os.close(fd)
        seg = _Segment(path, self.counter, size, mm)
        self.segments.append(seg)
        return seg

    def _drop(self, seg: _Segment) -> None:
        self.segments.remove(seg)
        os.unlink(seg.path)
        try:
            seg.mm.close()
        except BufferError:
            pass  # a view of it is still alive in this process; unmapped when that dies

    def close(self) -> None:
        """Remove the pool with what names it: the stream markers and the index files of payloads nobody read.
        Also the process' exit path (a finalizer): a replica that leaves a node where no other omni_serve process
        runs (so no janitor sweeps) leaves nothing behind."""
        for path in itertools.chain(self.published, self.streams):
            _remove(path)
            _rmdir(os.path.dirname(path))  # the stream's and the request's directories, if that emptied them
            _rmdir(os.path.dirname(os.path.dirname(path)))
        self.published.clear()
        self.streams.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self.lock_fd)


class ShmSettings(BaseModel):
    """``data_plane.shm``."""

    model_config = ConfigDict(extra="forbid")

    dir: str | None = Field(None, description=(
        "tmpfs directory of the segments (default: OMNI_SERVE_SHM_DIR or /dev/shm). Every process of a "
        "node must see the same directory."))
    pool_bytes: int | None = Field(None, ge=1 << 20, description=(
        "Bytes of segments one producing process may hold (unread payloads + free pool); default "
        "OMNI_SERVE_SHM_POOL_BYTES or 4 GiB. A put waits for space, then fails with a clear error."))


class SharedMemoryConnector(Connector):
    name = "shm"
    scope = "node"
    Settings = ShmSettings

    def __init__(self, root: str | os.PathLike | None = None, *, ttl_s: float | None = None,
                 pool_bytes: int | None = None, put_timeout_s: float = 30.0, directory: Any = "ray"):
        self.root = tree_path(root)
        open_private_tree(self.root)
        self.ttl_s = settings.DATA_TTL_S if ttl_s is None else ttl_s
        self.pool_bytes = settings.SHM_POOL_BYTES if pool_bytes is None else pool_bytes
        self.put_timeout_s = put_timeout_s  # how long a put waits for pool space before failing
        self._pool: _Pool | None = None
        self._pool_closer: weakref.finalize | None = None
        self._mapped: OrderedDict[str, mmap.mmap] = OrderedDict()
        self._directory = directory  # node announcements: "ray" (when Ray is up), None, or a test double
        self._announced: set[str] = set()
        self._sweeper = PeriodicSweep("shm", self.ttl_s, self.sweep)
        self._keys = str(self.root / "keys")
        self._pools = str(self.root / "pools")
        self._tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._seq = itertools.count()
        self.janitor = Janitor(self.root)
        self.collect_dead_pools()

    # -- paths --------------------------------------------------------------------------------------------
    @classmethod
    def from_settings(cls, section: ShmSettings | None) -> "SharedMemoryConnector":
        section = section or ShmSettings()
        return cls(root=section.dir, pool_bytes=section.pool_bytes)

    # Plain strings and os calls on the per-payload path: pathlib costs more than the tmpfs calls themselves.
    def _index_path(self, key: str) -> str:
        parts = split_key(key)
        if parts is None:
            return f"{self._keys}/_/{_name(key)}"
        rid, edge, index = parts
        return f"{self._keys}/{_name(rid)}/{_name(edge)}/{index}"

    def _request_dir(self, request_id: str) -> str:
        return f"{self._keys}/{_name(request_id)}"

    def _scratch(self, directory: str, kind: str) -> str:
        """A name no other party uses, next to the index files (renames stay within one directory)."""
        return f"{directory}/.{kind}-{self._tag}-{next(self._seq)}"

    def _segment_path(self, pool: str, number: int) -> str:
        return f"{self._pools}/{pool}/seg.{number}"

    # -- index files ----------------------------------------------------------------------------------------
    def _read_index(self, path: str) -> tuple[str | None, int, Any]:
        """(segment path or None, payload bytes, parsed codec header) of a claimed index file; ``RefusedPayload``
        for anything but a well-formed index file of ours (a link, a FIFO, another user's file, bad JSON)."""
        index = codec.parse_json(_read_ours(path, codec.MAX_HEADER + 4096), f"index file {path}")
        if type(index) is not dict or index.keys() != INDEX_KEYS or index["v"] != INDEX_FORMAT:
            raise RefusedPayload(f"{path} is not an index file of format {INDEX_FORMAT}")
        pool, number, nbytes = index["pool"], index["seg"], index["nbytes"]
        if type(nbytes) is not int or nbytes < 0:
            raise RefusedPayload(f"{path}: bad payload size {nbytes!r}")
        if pool is None and number is None:
            return None, nbytes, index["payload"]
        if type(pool) is not str or not POOL_ID.fullmatch(pool) or type(number) is not int or number < 1:
            raise RefusedPayload(f"{path}: bad segment ({pool!r}, {number!r})")
        return self._segment_path(pool, number), nbytes, index["payload"]

    def _index(self, seg: _Segment | None, nbytes: int, header: bytes) -> bytes:
        """The index file: one JSON document around the codec's header (by hand: ``json.dumps`` costs more
        than the rest of a small put; the pool id is ``[0-9a-f-]`` only)."""
        pool, number = (f'"{self.pool.id}"', seg.number) if seg else ("null", "null")
        return (f'{{"v":{INDEX_FORMAT},"pool":{pool},"seg":{number},"nbytes":{nbytes},"payload":'.encode()
                + header + b"}")

    def _read_claimed(self, claimed: str) -> tuple[str | None, int, Any]:
        """``_read_index`` of a file this process claimed (renamed to ``claimed``), which it then removes."""
        try:
            return self._read_index(claimed)
        finally:
            _remove(claimed)

    # -- producer -----------------------------------------------------------------------------------------
    @property
    def pool(self) -> _Pool:
        if self._pool is None:
            self._pool = _Pool(self.root, self.pool_bytes)
            self._pool_closer = weakref.finalize(self, _Pool.close, self._pool)
        return self._pool

    async def put(self, key: str, payload: Payload) -> None:
        self._sweeper.ensure()
        enc = codec.encode(payload)
        path = self._index_path(key)
        if not enc.nbytes:  # no tensors (token ids, flags): the index file is the whole payload
            self._publish(key, path, self._index(None, 0, enc.header))
            self.pool.published[path] = (None, time.monotonic())
            return
        seg = await self._acquire(enc.nbytes)
        try:
            view = memoryview(seg.mm)[HEADER:HEADER + enc.nbytes]
            try:
                await codec.write_into(enc, view)
            finally:
                view.release()
            self._publish(key, path, self._index(seg, enc.nbytes, enc.header))
        except BaseException:
            seg.mm[0] = FREE
            raise
        self.pool.published[path] = (seg.path, time.monotonic())

    def _publish(self, key: str, path: str, index: bytes) -> None:
        stream = os.path.dirname(path)
        for attempt in range(3):
            try:
                if stream not in self._announced:
                    _mkdir_private(os.path.dirname(stream))
                    _mkdir_private(stream)
                    self._announce(key, stream)
                tmp = self._scratch(stream, "tmp")
                _write_new(tmp, index)
                os.rename(tmp, path)  # replaces the name, never writes through a link planted there
                return
            except FileNotFoundError:
                # An idle-directory sweep removed the stream directory between mkdir and write.
                self._announced.discard(stream)
                if attempt == 2:
                    raise

    async def _acquire(self, nbytes: int) -> _Segment:
        deadline = time.monotonic() + self.put_timeout_s
        delay = 0.001
        while True:
            seg = self.pool.acquire(nbytes)
            if seg is not None:
                return seg
            if reclaim_dead_claims(str(self.pool.dir)):  # segments a dead reader held: free now
                continue
            if time.monotonic() > deadline:
                raise DataPlaneError(
                    f"shared-memory pool full: {self.pool.nbytes} bytes in payloads nobody has read or freed "
                    f"(limit OMNI_SERVE_SHM_POOL_BYTES={self.pool_bytes})")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _announce(self, key: str, stream: str) -> None:
        """Name this pool as the stream's producer (once per stream), locally and in the Ray directory."""
        marker = f"{stream}/producer"
        tmp = self._scratch(stream, "tmp")
        _write_new(tmp, self.pool.id.encode())
        os.rename(tmp, marker)
        self._announced.add(stream)
        self.pool.streams[marker] = time.monotonic()
        directory = self._node_directory()
        parts = split_key(key)
        if directory is not None and parts is not None:
            directory.announce(parts[0], parts[1], _node_id())

    # -- consumer -----------------------------------------------------------------------------------------
    async def get(self, key: str, timeout: float) -> Payload:
        self._sweeper.ensure()  # a reader sweeps too: its mappings, and the node's tree if it is the janitor
        path = self._index_path(key)
        stream = os.path.dirname(path)
        claimed = self._scratch(stream, "claimed")
        start = time.monotonic()
        deadline = start + timeout
        next_check = start + LIVENESS_PERIOD_S
        next_node_check = start + LIVENESS_PERIOD_S
        delay = POLL_FIRST_S
        while True:
            try:
                os.rename(path, claimed)
                break
            except FileNotFoundError:
                pass
            now = time.monotonic()
            if now >= deadline:
                raise DataPlaneTimeout(
                    f"data-plane payload {key} did not arrive within {timeout:.0f} s (shared memory: the "
                    "producer must run on this node)")
            if now >= next_check:
                ask_directory = now >= next_node_check
                await self._check_producer(key, stream, ask_directory)
                next_check = now + LIVENESS_PERIOD_S
                if ask_directory:
                    next_node_check = now + NODE_CHECK_PERIOD_S
            await asyncio.sleep(delay)
            delay = poll_delay(delay, now - start)
        with codec.refusing(key):
            seg_path, nbytes, header = self._read_claimed(claimed)
            return self._open(key, seg_path, nbytes, header)

    def _open(self, key: str, seg_path: str | None, nbytes: int, header: Any) -> Payload:
        if seg_path is None:
            return codec.rebuild(header, memoryview(b""))
        try:
            mm = self._map(seg_path)
        except FileNotFoundError:
            raise DataPlaneError(f"data-plane payload {key} is lost: its producer process died") from None
        if len(mm) < HEADER + nbytes:
            raise RefusedPayload(f"{seg_path} has {len(mm)} bytes, the index names {HEADER + nbytes}")
        mm[CLAIMANT] = process_token()  # if this process dies holding views, the janitor frees the segment
        area = memoryview(mm)[HEADER:HEADER + nbytes]
        try:
            payload = codec.rebuild(header, area)
        except Exception:
            area.release()
            mm[0] = FREE
            raise
        # The segment returns to its pool when the last tensor viewing ``area`` is gone (at once if none).
        weakref.finalize(area, mm.__setitem__, 0, FREE)
        return payload

    def _map(self, seg_path: str) -> mmap.mmap:
        mm = self._mapped.get(seg_path)
        if mm is not None:
            self._mapped.move_to_end(seg_path)
            return mm
        fd, _ = _open_ours(seg_path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._mapped[seg_path] = mm
        while len(self._mapped) > MAPPED_SEGMENTS:
            self._mapped.popitem(last=False)  # unmapped once no view of it is alive
        return mm

    def _producer_of(self, stream: str) -> str | None:
        """The pool id in a stream's producer marker (None: no marker, or not one of ours)."""
        try:
            pool_id = _read_ours(f"{stream}/producer", 64).decode("ascii", "replace")
        except (FileNotFoundError, RefusedPayload):
            return None
        return pool_id if POOL_ID.fullmatch(pool_id) else None

    async def _check_producer(self, key: str, stream: str, ask_directory: bool = True) -> None:
        """Fail a waiting get whose producer died (its pool's lock is free: a local check, every call) or runs on
        another node (``ask_directory``: an actor call, so the caller asks only every few seconds)."""
        pool_id = self._producer_of(stream)
        if pool_id and not _pool_alive(self.root / "pools" / pool_id):
            raise DataPlaneError(f"data-plane payload {key} will not arrive: its producer process died")
        directory = self._node_directory() if ask_directory else None
        parts = split_key(key)
        if pool_id is None and directory is not None and parts is not None:
            node = await directory.node_of(parts[0], parts[1])
            if node is not None and node != _node_id():
                raise DataPlaneError(
                    f"edge {parts[1]!r} uses the shared-memory connector but its producer runs on node "
                    f"{node} and this consumer on {_node_id()}: use connector 'mooncake' or 'ray' for edges "
                    "between nodes, or 'auto' (shared memory or Mooncake, chosen per producer/consumer pair)")

    # -- freeing ------------------------------------------------------------------------------------------
    def _drop_index(self, path: str) -> bool:
        """Claim an unread index file and release its segment; False if someone else claimed it."""
        claimed = self._scratch(os.path.dirname(path), "claimed")
        try:
            os.rename(path, claimed)
        except FileNotFoundError:
            return False
        try:
            seg_path = self._read_claimed(claimed)[0]
        except RefusedPayload as exc:
            log.warning("shared memory: discarded %s: %s", path, exc)
            return True
        if seg_path is not None:
            _release(seg_path)
        return True

    def _drop_claimed(self, claimed: str) -> bool:
        """Release what a claimed index file (its reader died before reading it) names, and remove it."""
        try:
            seg_path = self._read_claimed(claimed)[0]
        except (RefusedPayload, FileNotFoundError):
            return False
        if seg_path is not None:
            _release(seg_path)
        return True

    async def free(self, key: str) -> None:
        self._drop_index(self._index_path(key))

    async def free_request(self, request_id: str) -> None:
        rdir = self._request_dir(request_id)
        for stream in _subdirs(rdir):
            with os.scandir(stream) as entries:
                names = [e.name for e in entries]
            for name in names:
                if name.isdigit():
                    self._drop_index(f"{stream}/{name}")
            _remove(f"{stream}/producer")
            self._announced.discard(stream)
            _rmdir(stream)  # a reader mid-claim keeps it until it is done; the sweeper removes it later
        _rmdir(rdir)
        directory = self._node_directory()
        if directory is not None:
            directory.forget(request_id)

    # -- housekeeping -------------------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> int:
        """Release this process' payloads unread for longer than the TTL, forget its mappings of removed segments
        and, in the node's janitor process, sweep the whole tree (``omni_serve.transport.shm_janitor``: dead
        pools, segments held by dead readers, index files and markers past the TTL, whoever wrote them)."""
        now = time.monotonic() if now is None else now
        expired = 0
        pool = self._pool
        if pool is not None:
            for path, (_, t) in list(pool.published.items()):
                if not os.path.lexists(path):
                    del pool.published[path]  # read or freed
                elif now - t > self.ttl_s:
                    expired += self._drop_index(path)
                    del pool.published[path]
            for marker, t in list(pool.streams.items()):
                if now - t > self.ttl_s:
                    del pool.streams[marker]
                    self._announced.discard(os.path.dirname(marker))
                    _remove(marker)
        unmap_unlinked(self._mapped)
        if self.janitor.turn(min(self.ttl_s / 4, JANITOR_PERIOD_S)):
            expired += self.janitor.sweep_tree(self._drop_index, self._drop_claimed, self.ttl_s,
                                               self._own_pool_dir())["expired"]
        if expired:
            log.warning("shared memory: freed %d payloads nobody read within %.0f s", expired, self.ttl_s)
        return expired

    def keep_tidy(self) -> None:
        """Run this process' periodic sweep, and so its turns as the node's janitor, even if it never puts or
        reads through shared memory (call on the event loop): what processes that died on this node left is swept
        while any omni_serve process lives there."""
        self._sweeper.ensure()

    def _own_pool_dir(self) -> Path | None:
        return self._pool.dir if self._pool is not None else None

    def close(self) -> None:
        """Drop this process' unread payloads and stream markers, and remove its pool."""
        self._sweeper.stop()
        pool, closer, self._pool, self._pool_closer = self._pool, self._pool_closer, None, None
        if pool is not None:
            closer()  # runs _Pool.close once: its index files, markers and segments go
        self._announced.clear()
        self._mapped.clear()  # each segment is unmapped once no view of it is alive

    def remove_empty_dirs(self) -> None:
        """Remove request/stream directories left empty for longer than the TTL."""
        self.janitor.remove_empty_dirs(self.ttl_s)

    def collect_dead_pools(self) -> int:
        """Remove the pools of processes that died (their unread payloads can never be served)."""
        return self.janitor.collect_dead_pools(self._own_pool_dir())

    def _node_directory(self):
        if self._directory == "ray":
            self._directory = _RayNodeDirectory.create()
        return self._directory

    # -- introspection (tests, /health) -------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """``busy_segments``: this process' segments holding a payload nobody read, or one whose tensors a
        reader still uses (0 when idle); ``unread``: its payloads not claimed yet."""
        pool = self._pool
        if pool is None:
            return {"segments": 0, "pool_bytes": 0, "busy_segments": 0, "unread": 0}
        return {"segments": len(pool.segments), "pool_bytes": pool.nbytes,
                "busy_segments": sum(not s.free for s in pool.segments),
                "unread": sum(os.path.exists(p) for p in pool.published)}


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        pass
    return os.uname().nodename


class _RayNodeDirectory:
    """Stream -> producer node, kept in the data directory (``omni_serve.transport.directory``; Ray only), under
    ``@node/<request>/<edge>`` (apart from the payload keys other connectors keep there)."""

    def __init__(self, client):
        self.client = client

    @classmethod
    def create(cls):
        import ray

        if not ray.is_initialized():
            return None
        from omni_serve.transport.directory import directory

        return cls(directory())

    def announce(self, request_id: str, edge: str, node: str) -> None:
        self.client.send("put", f"@node/{request_id}/{edge}", node)  # fire and forget: off the fast path

    async def node_of(self, request_id: str, edge: str) -> str | None:
        try:
            return await asyncio.wait_for(self.client.call("lookup", f"@node/{request_id}/{edge}"), 1.0)
        except (asyncio.TimeoutError, DataPlaneError):
            return None

    def forget(self, request_id: str) -> None:
        self.client.send("free_prefix", f"@node/{request_id}/")
