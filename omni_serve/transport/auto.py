"""The ``auto`` connector: the fastest data-plane backend that reaches every consumer, chosen per process.

Contract:
- ``choose(data_plane)`` returns a ``Choice`` (backend name, reason):
  - ``OMNI_SERVE_AUTO_CONNECTOR`` when set (a registered backend name): a deployment that knows its topology
    better says so;
  - ``nearest`` when this process is connected to Ray (a deployed graph, one node or many): per stream, shared
    memory when producer and consumer share a node, Mooncake (or ``ray``) otherwise, decided at run time, so a
    cluster that gains or loses nodes keeps working (``omni_serve.transport.nearest``);
  - without Ray (one process): ``shm`` when the shared-memory directory is usable (a directory this user can
    write with at least ``SHM_MIN_FREE_BYTES`` free: a container's default 64 MiB /dev/shm is not, the payloads
    of one image request can exceed it); otherwise ``mooncake`` when its module loads, else ``ray``.
- ``resolve(name, data_plane)``: concrete names unchanged, ``auto`` the process' choice (made on first use and
  logged with its reason). The Serve builder resolves every ``auto`` edge before it binds the deployments when
  it can see the cluster (``can_choose_for_cluster``), so all replicas of a graph agree on the backend; a
  builder without Ray leaves ``auto`` to each replica, which is connected to Ray and chooses the same.
- Names come from the registry (``omni_serve.transport.registry``), which never imports this module; the
  process' connectors (``omni_serve.transport.connectors``) resolve ``auto`` here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from omni_serve import settings
from omni_serve.transport.registry import AUTO, known_connectors

log = logging.getLogger(__name__)

ENV = "OMNI_SERVE_AUTO_CONNECTOR"
SHM_MIN_FREE_BYTES = 256 << 20


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str


_CHOICE: Choice | None = None


def resolve(name: str, data_plane=None) -> str:
    """The backend an edge's ``connector`` names: itself, or for ``auto`` this process' choice."""
    global _CHOICE
    if name != AUTO:
        return name
    if _CHOICE is None:
        _CHOICE = choose(data_plane)
        log.info("connector 'auto' is %r: %s", _CHOICE.name, _CHOICE.reason)
    return _CHOICE.name


def can_choose_for_cluster() -> bool:
    """Whether this process sees what ``choose`` needs to decide for a whole cluster."""
    return bool(os.environ.get(ENV, "").strip()) or alive_nodes() is not None


def reset() -> None:
    """Forget the process' choice (tests; a driver that builds graphs for another cluster)."""
    global _CHOICE
    _CHOICE = None


def choose(data_plane=None) -> Choice:
    override = os.environ.get(ENV, "").strip()
    if override:
        if override == AUTO or override not in known_connectors():
            raise ValueError(f"{ENV}={override!r} is not a connector; registered: "
                             f"{', '.join(n for n in known_connectors() if n != AUTO)}")
        return Choice(override, f"{ENV} says so")
    nodes = alive_nodes()
    if nodes is not None:
        return Choice("nearest", f"the Ray cluster has {nodes} alive node(s): per stream, shared memory between "
                                 "stages of one node, Mooncake (or the Ray object store) between nodes")
    where = "Ray is not running: one process"
    usable, why = shm_usable(shm_dir(data_plane))
    if usable:
        return Choice("shm", f"{where}; {why}")
    where = f"{where}, but {why}"
    if mooncake_loads():
        return Choice("mooncake", f"{where}; the Mooncake Transfer Engine reaches every node")
    return Choice("ray", f"{where}; Mooncake is not installed, the Ray object store reaches every node")


def alive_nodes() -> int | None:
    """Alive nodes of the connected Ray cluster, None when this process has no Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    return sum(1 for node in ray.nodes() if node.get("Alive"))


def shm_dir(data_plane=None) -> str:
    section = getattr(data_plane, "shm", None)
    return getattr(section, "dir", None) or settings.SHM_DIR


def shm_usable(directory: str) -> tuple[bool, str]:
    """Whether the shm connector can live in ``directory``, and why (not)."""
    if not os.path.isdir(directory):
        return False, f"{directory} is not a directory"
    if not os.access(directory, os.W_OK | os.X_OK):
        return False, f"{directory} is not writable by this user"
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    if free < SHM_MIN_FREE_BYTES:
        return False, (f"{directory} has {free >> 20} MiB free, under the {SHM_MIN_FREE_BYTES >> 20} MiB shared "
                       f"memory needs")
    return True, f"shared memory in {directory} ({free >> 20} MiB free)"


def mooncake_loads() -> bool:
    try:
        import mooncake.engine  # noqa: F401 - the Transfer Engine's binding
    except Exception:  # noqa: BLE001 - ImportError, or a wheel whose shared library does not load here
        return False
    return True
