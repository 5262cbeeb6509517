"""Housekeeping of a node's shared-memory tree that does not depend on who wrote what (``omni_serve.transport.shm``).

A producer frees what it published and a consumer what it read; this module cleans up after the processes that
died before they could. Every process that uses the tree runs ``SharedMemoryConnector.sweep`` periodically; when
a sweep of the whole tree is due, the first of them to get there (the *janitor* of that turn) does it.

Contract:
- Liveness. A pool is alive while its owner holds the ``flock`` on its ``lock`` file (``pool_alive``). A
  process is named by its *token*, ``<pid>:<start time>`` from ``/proc`` (``process_token``), which no later
  process reuses; ``token_alive(token)`` says whether that very process still runs.
- Claims. A consumer writes its token into a segment's header (bytes ``CLAIMANT``) when it maps the segment to
  read it; the producer clears it when it reuses the segment. A segment left busy by a claimant that died (it held
  views of the payload when it was killed) is released by ``reclaim_dead_claims``.
- ``Janitor(root)``: ``turn(period_s)`` says whether this process sweeps the whole tree now (one process at a
  time, at most once per period, whichever processes live: see its doc). ``sweep_tree(claim_index, drop_claimed,
  ttl_s)``: removes dead pools, releases the busy segments of dead claimants in live pools, claims
  (``claim_index``) every index file older than the TTL, releases what an index file claimed by a reader that
  died before reading it names (``drop_claimed``), removes producer markers and unpublished scratch files older
  than it, and removes stream and request directories left empty for longer than it. Ages are wall-clock (file
  modification times), so they hold across processes.
- ``unmap_unlinked(mapped)``: drops a process' mappings of segments whose files are gone (their pool was
  removed or shrank), so their tmpfs pages go back to the node once no view of them is alive.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable

from omni_serve.transport.shm_tree import OPEN, idle, remove, rmdir_quiet, subdirs

log = logging.getLogger(__name__)

FREE, BUSY = 0, 1
CLAIMANT = slice(8, 40)  # header bytes holding the claimant's token (ASCII, NUL padded)
NO_CLAIMANT = bytes(CLAIMANT.stop - CLAIMANT.start)


def _start_time(pid: int) -> str | None:
    """The process' start time (clock ticks since boot, ``/proc/<pid>/stat`` field 22), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing one
    fields = stat_line[stat_line.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


_TOKEN: bytes | None = None
_TOKEN_PID = -1


def process_token() -> bytes:
    """This process' token, ``<pid>:<start time>``, NUL padded to the claimant field (recomputed after a fork)."""
    global _TOKEN, _TOKEN_PID
    if _TOKEN_PID != os.getpid():
        pid = os.getpid()
        _TOKEN = f"{pid}:{_start_time(pid)}".encode().ljust(len(NO_CLAIMANT), b"\0")[:len(NO_CLAIMANT)]
        _TOKEN_PID = pid
    return _TOKEN


def token_alive(token: bytes) -> bool:
    """Whether the process a claimant token names still runs (a token that does not parse counts as alive:
    nothing is reclaimed on a guess)."""
    text = token.rstrip(b"\0").decode("ascii", "replace")
    pid, _, start = text.partition(":")
    if not pid.isdigit() or not start:
        return True
    return _start_time(int(pid)) == start


def pool_alive(pool_dir: Path | str) -> bool:
    """True while the pool's owner process holds its lock."""
    try:
        fd = os.open(os.path.join(pool_dir, "lock"), os.O_RDWR | OPEN)
    except OSError:  # gone, or a planted link
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock if we just took it
    return False


def release(path: str) -> None:
    """Mark a segment free from any process (its owner reuses it on a later put)."""
    try:
        fd = os.open(path, os.O_WRONLY | OPEN)
    except OSError:
        return  # its pool is gone (or a planted link: never written through)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.pwrite(fd, bytes([FREE]), 0)
    finally:
        os.close(fd)


def reclaim_dead_claims(pool_dir: str) -> int:
    """Release the busy segments of ``pool_dir`` whose claimant process died; returns how many."""
    reclaimed = 0
    try:
        names = [n for n in os.listdir(pool_dir) if n.startswith("seg.")]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(pool_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | OPEN)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            head = os.pread(fd, CLAIMANT.stop, 0)
            if len(head) < CLAIMANT.stop or head[0] != BUSY:
                continue
            token = head[CLAIMANT]
            if token != NO_CLAIMANT and not token_alive(token):
                os.pwrite(fd, bytes([FREE]), 0)
                reclaimed += 1
        finally:
            os.close(fd)
    return reclaimed


def unmap_unlinked(mapped: "OrderedDict[str, object]") -> int:
    """Forget the mappings of segments whose files are gone; returns how many."""
    gone = [path for path in mapped if not os.path.exists(path)]
    for path in gone:
        mapped.pop(path, None)  # unmapped once no view of it is alive
    return len(gone)


class Janitor:
    def __init__(self, root: Path):
        self.root = root

    def turn(self, period_s: float) -> bool:
        """Whether this process sweeps the whole tree now: no other process is sweeping it (an ``flock`` on
        ``<tree>/janitor``, held only while it sweeps) and its last sweep is at least ``period_s`` old (the
        file's modification time). So a live process sweeps whenever one is due, whichever processes died."""
        path, first = self.root / "janitor", False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | OPEN, 0o600)
            first = True  # the tree's first sweep is due at once
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR | OPEN)
            except OSError:
                return False
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not first and time.time() - os.fstat(fd).st_mtime < period_s:
                return False
            os.utime(fd)  # this sweep's time: the others wait a period
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # the lock only orders the check and the stamp

    def collect_dead_pools(self, own: Path | None = None) -> int:
        """Remove the pools of processes that died (their unread payloads can never be served)."""
        removed = 0
        for pool_dir in map(Path, subdirs(self.root / "pools")):
            if pool_dir.name.startswith(".new-"):
                pid = pool_dir.name[5:].split("-")[0]
                if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                    shutil.rmtree(pool_dir, ignore_errors=True)
                continue
            if pool_dir == own:
                continue
            if not pool_alive(pool_dir):
                shutil.rmtree(pool_dir, ignore_errors=True)
                removed += 1
        return removed

    def remove_empty_dirs(self, ttl_s: float) -> None:
        """Remove request/stream directories left empty for longer than the TTL."""
        wall = time.time()
        for rdir in subdirs(self.root / "keys"):
            emptied = False
            for stream in subdirs(rdir):
                if idle(stream, wall, ttl_s):
                    rmdir_quiet(stream)
                    emptied = emptied or not os.path.lexists(stream)
            # removing its last stream made it look fresh: it goes too (a producer racing to create a stream in
            # it retries, see SharedMemoryConnector._publish)
            if emptied or idle(rdir, wall, ttl_s):
                rmdir_quiet(rdir)

    def sweep_tree(self, claim_index: Callable[[str], bool], drop_claimed: Callable[[str], bool], ttl_s: float,
                   own: Path | None = None) -> dict:
        """The janitor's sweep of the whole tree (see the module doc); returns what it did, by kind."""
        done = {"dead_pools": self.collect_dead_pools(own), "dead_claims": 0, "expired": 0, "markers": 0}
        for pool_dir in subdirs(self.root / "pools"):
            if not os.path.basename(pool_dir).startswith(".new-"):
                done["dead_claims"] += reclaim_dead_claims(pool_dir)
        wall = time.time()
        for rdir in subdirs(self.root / "keys"):
            for stream in subdirs(rdir):
                try:
                    with os.scandir(stream) as entries:
                        names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
                except OSError:
                    continue
                for name in names:
                    path = f"{stream}/{name}"
                    if not idle(path, wall, ttl_s):
                        continue
                    if name.isdigit():
                        done["expired"] += claim_index(path)
                    elif name == "producer":
                        remove(path)
                        done["markers"] += 1
                    elif name.startswith(".claimed-"):  # its reader died between the claim and the read
                        done["expired"] += drop_claimed(path)
                    elif name.startswith(".tmp-"):  # its writer died before publishing it
                        remove(path)
        self.remove_empty_dirs(ttl_s)
        if done["dead_pools"] or done["dead_claims"] or done["expired"]:
            log.warning("shared memory: the node's janitor removed %d dead pools, released %d segments held by "
                        "dead readers and freed %d payloads nobody read within %.0f s", done["dead_pools"],
                        done["dead_claims"], done["expired"], ttl_s)
        return done
