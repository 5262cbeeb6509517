"""The shared-memory connector's file system: a tree private to the serving user, and files opened safely in it.

Contract (the trust boundary of ``omni_serve.transport.shm``):
- ``tree_path(directory, namespace)``: ``<directory>/omni_serve.<euid>.<namespace>``; ``open_private_tree(root)``
  creates it (and its ``pools``, ``keys``) 0700 or verifies an existing one, raising ``UnsafeSharedMemory`` (naming
  the path and the fault) for a symlink, a non-directory, another owner, group/other access, or a parent others
  could replace it in (a shared parent must be sticky, like ``/dev/shm``, or a pod's own memory volume:
  kubelet's ``emptyDir``, a root-owned 0777/2777 tmpfs mount).
- ``mkdir_private``/``write_new`` create directories and files that did not exist (0700 / 0600, ``O_EXCL``,
  never through a planted link); ``open_ours``/``read_ours`` open only regular files of this uid not open to
  others, without following links (``RefusedPayload`` otherwise).
- ``remove``, ``rmdir_quiet``, ``idle``, ``subdirs``: housekeeping that never follows a link.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
import stat
from pathlib import Path
from urllib.parse import quote

from omni_serve import settings
from omni_serve.transport.base import DataPlaneError
from omni_serve.transport.codec import RefusedPayload

log = logging.getLogger(__name__)

# New files: exclusive, never through a planted link, not inherited by children.
CREATE = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Existing files: no link followed; a planted FIFO must not block the open.
OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafeSharedMemory(DataPlaneError):
    """The shared-memory tree (or its parent) could be read or replaced by another user: not used."""


def tree_path(directory: str | os.PathLike | None = None, namespace: str | None = None) -> Path:
    """This user's shared-memory tree: ``<directory>/omni_serve.<euid>.<namespace>``."""
    ns = name_part(namespace if namespace is not None else settings.RAY_NAMESPACE)
    return Path(directory or settings.SHM_DIR) / f"omni_serve.{os.geteuid()}.{ns}"


@functools.lru_cache(maxsize=4096)  # request ids and edge names repeat for every chunk
def name_part(part: str) -> str:
    """One path component for a key part: no '/', and never '.', '..' or a dot file."""
    quoted = quote(part, safe="")
    return "%2E" + quoted[1:] if quoted.startswith(".") else quoted


def unsafe(path: Path | str, fault: str) -> UnsafeSharedMemory:
    return UnsafeSharedMemory(
        f"shared-memory data plane: refusing to use {path}: {fault}. Another local user could read the "
        "payloads or plant its own; remove it (or fix it), or point data_plane.shm.dir / OMNI_SERVE_SHM_DIR "
        "elsewhere")


def check_parent(parent: Path) -> None:
    """Others must not be able to rename the tree away: the parent is ours or root's, and sticky if shared, or
    a pod's own memory volume (``pod_memory_volume``)."""
    st = os.stat(parent)
    if st.st_uid not in (0, os.geteuid()):
        raise unsafe(parent, f"the directory holding the tree is owned by uid {st.st_uid}, not by root or "
                              f"this process' uid {os.geteuid()}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        if pod_memory_volume(parent, st):
            _warn_pod_volume(str(parent))
            return
        raise unsafe(parent, f"the directory holding the tree has mode {st.st_mode & 0o7777:04o}: writable by "
                              "group or others without the sticky bit")


def pod_memory_volume(path: Path, st: os.stat_result) -> bool:
    """Whether ``path`` looks like a Kubernetes ``emptyDir`` with ``medium: Memory``: a tmpfs mount point owned
    by root with mode 0777 (2777 with the pod's ``fsGroup``), no sticky bit. kubelet mounts such a volume into
    the containers of one pod only, so the only parties that could rename the tree away are that pod's own
    containers; and even then the tree's 0700 directories and 0600 files (checked by owner on every open) keep
    them from reading or planting payloads. A host directory with these modes is refused."""
    if st.st_uid != 0 or stat.S_IMODE(st.st_mode) & ~stat.S_ISGID != 0o777 or not os.path.ismount(path):
        return False
    return _fs_type(os.path.realpath(path)) == "tmpfs"


def _fs_type(path: str) -> str | None:
    """The file-system type of the mount at ``path`` (/proc/self/mountinfo), or None."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    found = None
    for fields in mounts:  # the last mount on a path is the one in effect
        sep = fields.index("-")
        if fields[4].replace("\\040", " ") == path:
            found = fields[sep + 1]
    return found


@functools.lru_cache(maxsize=None)
def _warn_pod_volume(path: str) -> None:
    log.warning("shared-memory data plane: %s is a memory volume writable by everyone without the sticky bit "
                "(a Kubernetes emptyDir); accepted, since only this pod's containers mount it", path)


def check_private_dir(path: Path) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise unsafe(path, "it is a symlink")
    if not stat.S_ISDIR(st.st_mode):
        raise unsafe(path, "it is not a directory")
    if st.st_uid != os.geteuid():
        raise unsafe(path, f"it is owned by uid {st.st_uid}, not by this process' uid {os.geteuid()}")
    if st.st_mode & 0o077:
        raise unsafe(path, f"its mode is {st.st_mode & 0o7777:04o}: group or others can access it (0700 needed)")


def open_private_tree(root: Path) -> None:
    """Create the tree (``root``, ``pools``, ``keys``) mode 0700, or verify the existing one is private."""
    root.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_parent(root.parent)
    for path in (root, root / "pools", root / "keys"):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        check_private_dir(path)


def mkdir_private(path: str) -> None:
    """A request or stream directory inside the tree (a planted link in its place is refused)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise unsafe(path, "it is not a directory (a link?)") from None


def write_new(path: str, data: bytes) -> None:
    """Write a file that did not exist (mode 0600, ``O_EXCL``: never another party's file or link)."""
    fd = os.open(path, CREATE | os.O_WRONLY, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def open_ours(path: str, flags: int) -> tuple[int, os.stat_result]:
    """(fd, stat) of a regular file of this user, not open to group or others, opened without following a
    link; ``RefusedPayload`` for anything else (``FileNotFoundError`` when there is nothing)."""
    try:
        fd = os.open(path, flags | OPEN)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise RefusedPayload(f"{path} is a symlink") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        kind = "a regular file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise RefusedPayload(f"{path} is {kind} of uid {st.st_uid} with mode {st.st_mode & 0o7777:04o}, not a "
                             f"private file of uid {os.geteuid()}")
    return fd, st


def read_ours(path: str, limit: int) -> bytes:
    """The bytes of a file ``open_ours`` accepts, of at most ``limit`` bytes."""
    fd, st = open_ours(path, os.O_RDONLY)
    try:
        if st.st_size > limit:
            raise RefusedPayload(f"{path} has {st.st_size} bytes (more than {limit})")
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except IsADirectoryError:  # something planted under a name we claimed
        shutil.rmtree(path, ignore_errors=True)


def rmdir_quiet(path: Path | str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty, or already gone


def idle(path: str, wall_now: float, ttl_s: float) -> bool:
    try:
        return wall_now - os.lstat(path).st_mtime > ttl_s
    except FileNotFoundError:
        return False


def subdirs(path: Path | str) -> list[str]:
    """The real directories in ``path`` (links are never followed into)."""
    try:
        with os.scandir(path) as entries:
            return [e.path for e in entries if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []
