"""Mooncake connectors: the Transfer Engine (P2P reads from the producer's memory) and the Mooncake Store.

Both keep a payload's small part (the codec's JSON header: shapes, dtypes, ints, lists; never a pickle, so
bytes a peer sends cannot run code here) in the Ray data directory entry of its key, and its tensor bytes in
Mooncake; the directory also wakes a consumer that waits for a key, and ``wait(take=True)`` makes the
claim atomic (exactly one of consumer, TTL sweeper, ``free_request`` gets an entry). Every process has one
``RegionPool`` registered with Mooncake once: producers stage tensors in it, consumers receive into it and
get zero-copy tensor views; a consumer's region returns to the pool when the last view dies.

``mooncake`` (Transfer Engine, ``MooncakeTransferConnector``): ``put`` copies the tensors into a region of
the producer's pool (a 64-byte state header first, state 1 = unread) and publishes ``(rpc session, address,
size, header)``. ``get`` reads the bytes with ``transfer_sync_read`` (P2P handshake, no etcd; tcp here,
rdma in production), then writes state 0 into the producer's region, which the producer reclaims on its
next put. A dead producer makes the read fail (``DataPlaneError``).

``mooncake_store`` (``MooncakeStoreConnector``): ``put`` is ``put_from`` of the staged region into the
Store (placed in the producer's own global segment), ``get`` is ``get_into`` + ``remove``;
``free_request`` is one ``remove_by_regex`` over the request's keys. The master comes from
``MooncakeSettings.master_address``, or omni_serve starts one (``mooncake_master`` from the wheel) in a
detached Ray actor on the head node that kills it when it dies; it listens on the node's IP, so store clients on
every node reach it.

Unread payloads are freed by their producer after ``OMNI_SERVE_DATA_TTL_S``. Mooncake logs at ERROR unless
``MC_LOG_LEVEL`` is set, and a stalled peer times out after ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (default 5 s
here, the library's is 30 s).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import re
import time
import weakref
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_serve import settings
from omni_serve.transport import codec
from omni_serve.transport.base import Connector, DataPlaneError, DataPlaneTimeout, PeriodicSweep, in_thread
from omni_serve.transport.message_types import Payload
from omni_serve.transport.regions import RegionPool

log = logging.getLogger(__name__)

STATE = 64  # bytes before a Transfer Engine payload: byte 0 is 1 while unread, 0 once read
POLL_S = 0.002


def _mooncake_env() -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read at import; uppercase only
    os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # fail in seconds, not 90 s, without a master


def _local_host(spec) -> str:
    if spec.local_hostname:
        return spec.local_hostname
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001
        pass
    return "127.0.0.1"


class MooncakeSettings(BaseModel):
    """``data_plane.mooncake``: the settings of both Mooncake connectors."""

    model_config = ConfigDict(extra="forbid")

    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Transfer Engine transport: tcp, or rdma in production.")
    device_name: str = Field("", description="RDMA NICs for protocol rdma (e.g. 'mlx5_0,mlx5_1'); empty for tcp.")
    local_hostname: str | None = Field(None, description=(
        "Address peers reach this process at (default: this node's IP as Ray sees it, else 127.0.0.1)."))
    metadata_server: str = Field("P2PHANDSHAKE", description=(
        "Transfer Engine metadata: P2PHANDSHAKE (peers exchange buffer metadata directly; no etcd), or an "
        "etcd/http metadata URL."))
    buffer_bytes: int = Field(512 << 20, ge=1 << 20, description=(
        "Registered host buffer per process for the Mooncake connectors: payloads a process produced and "
        "nobody read yet, plus payloads it read and still uses (zero-copy). Pages are touched lazily."))
    master_address: str | None = Field(None, description=(
        "Mooncake Store master 'host:port'. None: omni_serve starts a mooncake_master on first use, on the "
        "head node at its IP (every node reaches it; it lives as long as the cluster's head)."))
    global_segment_bytes: int = Field(512 << 20, ge=1 << 20, description=(
        "Memory each process contributes to the Mooncake Store's distributed pool."))
    local_buffer_bytes: int = Field(64 << 20, ge=1 << 20, description=(
        "Mooncake Store client's own transfer buffer per process (its non-zero-copy calls)."))
    master_port: int = Field(50051, ge=1, le=65535, description=(
        "RPC port of the master omni_serve starts when master_address is None."))


class _MooncakeConnector(Connector):
    """What both backends share: the registered pool, the directory, claims, TTL, zero-copy reads."""

    Settings = MooncakeSettings
    settings_section = "mooncake"

    def __init__(self, spec: MooncakeSettings | None = None, *, ttl_s: float | None = None,
                 put_timeout_s: float = 30.0):
        self.spec = spec or MooncakeSettings()
        self.ttl_s = settings.DATA_TTL_S if ttl_s is None else ttl_s
        self.put_timeout_s = put_timeout_s
        self.pool = RegionPool(self.spec.buffer_bytes)
        self.outstanding: dict[str, tuple[int, float]] = {}  # key -> (region offset, put time); producer side
        self.unpublished: set[str] = set()  # puts not (yet) in the directory: cancelled ones are abandoned
        self._sweeper = PeriodicSweep(self.name, self.ttl_s, self.sweep)
        self._started = False

    @classmethod
    def from_settings(cls, section: MooncakeSettings | None) -> "_MooncakeConnector":
        return cls(section)

    @property
    def directory(self):
        from omni_serve.transport.directory import directory

        return directory()

    def _ensure_started(self) -> None:
        if not self._started:
            _mooncake_env()
            self.start()
            self._started = True

    @abc.abstractmethod
    def start(self) -> None:
        """Initialize the engine/client and register ``self.pool``."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Undo ``start``: unregister ``self.pool`` and drop the engine/client."""

    def close(self) -> None:
        """Stop the sweep and the engine/client. This process' unread payloads become unreadable (a consumer
        gets the ``DataPlaneError`` of a dead producer) and their regions return to the pool."""
        self._sweeper.stop()
        if self._started:
            self._started = False
            self.stop()
        for offset, _ in self.outstanding.values():
            if offset >= 0:
                self.pool.free(offset)
        self.outstanding.clear()
        self.unpublished.clear()

    # -- regions ------------------------------------------------------------------------------------------
    async def _allocate(self, n: int) -> int:
        deadline = time.monotonic() + self.put_timeout_s
        while True:
            offset = self.pool.allocate(n)
            if offset is not None:
                return offset
            self.reclaim()
            if time.monotonic() > deadline:
                raise DataPlaneError(
                    f"{self.name}: registered buffer full ({self.pool.used_bytes} of {self.pool.nbytes} bytes in "
                    "payloads nobody has read or freed); raise data_plane.mooncake.buffer_bytes")
            await asyncio.sleep(POLL_S)

    def reclaim(self) -> None:
        """Return regions whose payloads were consumed (backends with remote release override)."""

    # -- Connector ----------------------------------------------------------------------------------------
    async def put(self, key: str, payload: Payload) -> None:
        self._ensure_started()
        self._sweeper.ensure()
        enc = codec.encode(payload)
        entry: dict[str, Any] = {"header": enc.header, "nbytes": enc.nbytes}
        self.unpublished.add(key)
        if enc.nbytes:
            await self._stage_and_publish(key, enc, entry)
        else:
            self.outstanding[key] = (-1, time.monotonic())
        await self.directory.call("put", key, entry, owned=True)
        self.unpublished.discard(key)

    @abc.abstractmethod
    async def _stage_and_publish(self, key: str, enc: codec.Encoded, entry: dict[str, Any]) -> None:
        """Make the tensor bytes of ``enc`` readable under ``key``; add what readers need to ``entry``."""

    async def get(self, key: str, timeout: float) -> Payload:
        self._ensure_started()
        entry = await self._take(key, timeout)
        if entry is None:
            raise DataPlaneTimeout(f"data-plane payload {key} did not arrive within {timeout:.0f} s")
        n = entry["nbytes"]
        if not n:
            with codec.refusing(key):
                return codec.decode(entry["header"], memoryview(b""))
        try:
            offset = await self._allocate(n)
            try:
                await in_thread(self._fetch, key, entry, self.pool.address(offset), n)
            except BaseException:
                self.pool.free(offset)
                raise
        except BaseException:
            self._drop(key, entry)  # claimed but not read (cancelled, failed): release the source
            raise
        area = self.pool.view(offset, n)
        try:
            with codec.refusing(key):
                payload = codec.decode(entry["header"], area)
        except BaseException:
            area.release()
            self.pool.free(offset)
            raise
        weakref.finalize(area, self.pool.free, offset)  # the region returns when the last view dies
        return payload

    async def _take(self, key: str, timeout: float) -> dict[str, Any] | None:
        """Claim ``key``'s directory entry. If the caller is cancelled while the claim is in flight, the
        claim may still succeed in the directory: release whatever it took, in the background."""
        claim = asyncio.ensure_future(self.directory.call("wait", key, timeout, take=True))
        try:
            return await asyncio.shield(claim)
        except asyncio.CancelledError:
            claim.add_done_callback(lambda f: self._release_late(key, f))
            raise

    def _release_late(self, key: str, claim: asyncio.Future) -> None:
        if not claim.cancelled() and claim.exception() is None and claim.result() is not None:
            try:
                self._drop(key, claim.result())
            except Exception:  # noqa: BLE001 - the producer's stale-payload sweep is the backstop
                log.exception("%s: releasing %s after a cancelled read failed", self.name, key)

    @abc.abstractmethod
    def _fetch(self, key: str, entry: dict[str, Any], dst: int, n: int) -> None:
        """Copy the payload's tensor bytes into local registered memory at ``dst`` and release the source."""

    async def free(self, key: str) -> None:
        entry = await self.directory.call("wait", key, 0, take=True)
        if entry is not None:
            self._ensure_started()  # e.g. the ingress frees payloads of edges it never used itself
            self._drop(key, entry)

    async def free_request(self, request_id: str) -> None:
        entries = await self.directory.call("take_prefix", f"{request_id}/")
        if entries:
            self._ensure_started()
        for key, entry in entries.items():
            try:
                self._drop(key, entry)
            except Exception:  # noqa: BLE001 - free the others; the producer's TTL is the backstop
                log.exception("%s: freeing %s failed", self.name, key)

    @abc.abstractmethod
    def _drop(self, key: str, entry: dict[str, Any]) -> None:
        """Release an unread payload (claimed from the directory by this process)."""

    # -- TTL ----------------------------------------------------------------------------------------------
    async def sweep(self, now: float | None = None) -> int:
        """Free this process' payloads nobody claimed within the TTL; returns how many."""
        now = time.monotonic() if now is None else now
        self.reclaim()
        expired = 0
        for key, (_, t) in list(self.outstanding.items()):
            if now - t <= self.ttl_s:
                continue
            if key in self.unpublished:  # its put was cancelled or failed midway
                self.unpublished.discard(key)
                self._abandon(key)
                await self.directory.call("free", key)
                continue
            entry = await self.directory.call("wait", key, 0, take=True)
            if entry is not None:
                self._drop(key, entry)
                expired += 1
            self._forget(key, stale=entry is None and now - t > 2 * self.ttl_s)
        if expired:
            log.warning("%s: freed %d payloads nobody read within %.0f s", self.name, expired, self.ttl_s)
        return expired

    @abc.abstractmethod
    def _abandon(self, key: str) -> None:
        """Free what a put that never published ``key`` left behind."""

    def _forget(self, key: str, stale: bool) -> None:
        """Stop tracking ``key`` once its payload is gone (``stale``: claimed but never released)."""
        if stale or key in self.outstanding and self.outstanding[key][0] < 0:
            self.outstanding.pop(key, None)

    def stats(self) -> dict[str, int]:
        """``regions``/``used_bytes``: payloads this process produced and nobody read yet, plus payloads it
        read whose tensors are still alive (0 when idle)."""
        self.reclaim()
        fixed = 1 if self._started and self.name == "mooncake" else 0  # the registered zero byte
        return {"regions": self.pool.num_regions - fixed, "used_bytes": self.pool.used_bytes - fixed * 64}


class MooncakeTransferConnector(_MooncakeConnector):
    name = "mooncake"

    def start(self) -> None:
        from mooncake.engine import TransferEngine

        s = self.spec
        self.engine = TransferEngine()
        host = _local_host(s)
        if self.engine.initialize(host, s.metadata_server, s.protocol, s.device_name) != 0:
            raise DataPlaneError(f"mooncake: TransferEngine.initialize({host}, {s.metadata_server}, {s.protocol}) failed")
        if self.engine.register_memory(self.pool.base, self.pool.nbytes) != 0:
            raise DataPlaneError("mooncake: register_memory of the payload buffer failed")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._zero = self.pool.allocate(1)  # a registered 0 byte: the source of remote "read" marks
        self.pool.buffer[self._zero] = 0

    def stop(self) -> None:
        if self.engine.unregister_memory(self.pool.base) != 0:
            log.warning("mooncake: unregister_memory of the payload buffer failed")
        self.pool.free(self._zero)
        self.engine = None  # the binding has no shutdown call: the engine ends when it is collected

    async def _stage_and_publish(self, key, enc, entry) -> None:
        offset = await self._allocate(STATE + enc.nbytes)
        self.pool.buffer[offset] = 1
        self.outstanding[key] = (offset, time.monotonic())  # tracked before any await: the sweep frees it
        view = self.pool.view(offset + STATE, enc.nbytes)
        await codec.write_into(enc, view)
        entry.update(session=self.session, addr=self.pool.address(offset))

    def _fetch(self, key, entry, dst, n) -> None:
        if self.engine.transfer_sync_read(entry["session"], dst, entry["addr"] + STATE, n) != 0:
            raise DataPlaneError(f"data-plane payload {key} is lost: reading it from {entry['session']} failed "
                                 "(its producer died or unregistered it)")
        self._mark_read(entry)

    def _mark_read(self, entry) -> None:
        if entry["session"] == self.session:
            self.pool.buffer[entry["addr"] - self.pool.base] = 0
        elif self.engine.transfer_sync_write(entry["session"], self.pool.address(self._zero), entry["addr"], 1) != 0:
            log.warning("mooncake: could not mark a payload read at %s (producer gone?)", entry["session"])

    def reclaim(self) -> None:
        for key, (offset, _) in list(self.outstanding.items()):
            if offset >= 0 and self.pool.buffer[offset] == 0:
                self.pool.free(offset)
                del self.outstanding[key]

    def _drop(self, key, entry) -> None:
        if entry.get("addr") is not None:
            self._mark_read(entry)
        self.reclaim()

    def _abandon(self, key) -> None:
        offset = self.outstanding.pop(key, (-1, 0))[0]
        if offset >= 0:
            self.pool.free(offset)

    def _forget(self, key, stale) -> None:
        if stale:
            offset = self.outstanding.pop(key)[0]
            if offset >= 0:
                self.pool.free(offset)
        else:
            super()._forget(key, stale)


class MooncakeStoreConnector(_MooncakeConnector):
    name = "mooncake_store"

    def __init__(self, spec=None, **kwargs):
        super().__init__(spec, **kwargs)
        self.handed_off: dict[str, float] = {}  # key -> put time, of objects a consumer claimed

    def start(self) -> None:
        from mooncake.store import MooncakeDistributedStore

        s = self.spec
        master = s.master_address or ensure_local_master(s.master_port)
        self.store = MooncakeDistributedStore()
        host = _local_host(s)
        rc = self.store.setup(host, s.metadata_server, s.global_segment_bytes, s.local_buffer_bytes,
                              s.protocol, s.device_name, master)
        if rc != 0:
            raise DataPlaneError(f"mooncake_store: setup against master {master} failed (rc {rc}); is it running?")
        if self.store.register_buffer(self.pool.base, self.pool.nbytes) != 0:
            raise DataPlaneError("mooncake_store: register_buffer of the payload buffer failed")
        self.master = master

    def stop(self) -> None:
        self.handed_off.clear()  # closing the client unmounts its segment: the objects it held are gone
        if self.store.unregister_buffer(self.pool.base) != 0:
            log.warning("mooncake_store: unregister_buffer of the payload buffer failed")
        self.store.close()
        self.store = None

    async def _stage_and_publish(self, key, enc, entry) -> None:
        from mooncake.store import ReplicateConfig

        offset = await self._allocate(enc.nbytes)
        self.outstanding[key] = (-1, time.monotonic())  # tracked before any await: the sweep removes it
        try:
            await codec.write_into(enc, self.pool.view(offset, enc.nbytes))
            config = ReplicateConfig()
            config.preferred_segment = self.store.get_hostname()  # keep it in this process until read
            rc = await in_thread(self.store.upsert_from, key, self.pool.address(offset), enc.nbytes, config)
            if rc != 0:
                raise DataPlaneError(f"mooncake_store: storing {key} ({enc.nbytes} bytes) failed (rc {rc})")
        finally:
            self.pool.free(offset)  # the Store holds its own copy

    def _fetch(self, key, entry, dst, n) -> None:
        got = self.store.get_into(key, dst, n)
        self.store.remove(key, force=True)
        if got != n:
            raise DataPlaneError(f"data-plane payload {key} is lost: the Mooncake Store returned {got} "
                                 "(its producer died, or the store evicted it)")

    def _drop(self, key, entry) -> None:
        if entry["nbytes"]:
            self.store.remove(key, force=True)
        self.outstanding.pop(key, None)

    async def free_request(self, request_id: str) -> None:
        await super().free_request(request_id)
        if self._started:  # objects whose directory entry a consumer took but never removed (it died)
            self.store.remove_by_regex(f"^{re.escape(request_id)}/", force=True)

    def _forget(self, key, stale) -> None:
        # A consumer claimed it and removes the object as it reads it. Should that removal not happen (a read
        # cut short by a cancellation, a remove the master refused), the producer removes it at 2 x TTL
        # after its put: every object this process put is gone by then (removing a gone key is a no-op).
        put = self.outstanding.pop(key, None)
        if put is not None:
            self.handed_off[key] = put[1]

    async def sweep(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = await super().sweep(now)
        due = [key for key, put_t in self.handed_off.items() if now - put_t > 2 * self.ttl_s]
        if due:  # one master round trip per sweep, not one per object
            for key in due:
                del self.handed_off[key]
            self.store.batch_remove(due, True)
        return expired

    def _abandon(self, key) -> None:
        self.outstanding.pop(key, None)
        self.store.remove(key, force=True)


# -- the master omni_serve starts when none is configured -----------------------------------------------------
MASTER_ACTOR = "omni_serve_mooncake_master"


def master_command(port: int, bind: str = "0.0.0.0") -> list[str]:
    import mooncake

    binary = os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")
    return [binary, f"--rpc_port={port}", f"--rpc_address={bind}", f"--metrics_port={port + 1}",
            f"--metrics_host={bind}", "--logtostderr", "--client_ttl=5"]


def start_master_process(port: int, timeout_s: float = 30.0, bind: str = "0.0.0.0", probe: str = "127.0.0.1"):
    """Start ``mooncake_master`` listening on ``bind``:``port`` as a child that dies with this process; wait
    until ``probe``:``port`` answers."""
    import ctypes
    import signal
    import socket
    import subprocess

    def die_with_parent():
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    proc = subprocess.Popen(master_command(port, bind), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DataPlaneError(f"mooncake_master exited with {proc.returncode} (port {port} in use?)")
        try:
            socket.create_connection((probe, port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise DataPlaneError(f"mooncake_master did not listen on port {port} within {timeout_s:.0f} s")


class _MasterHolder:
    """Ray actor owning the master process (it dies with the actor: PR_SET_PDEATHSIG). The master listens on
    every interface of the actor's node; its address is that node's IP, which every node of the cluster reaches."""

    def __init__(self, port: int):
        import ray

        self.port = port
        self.ip = ray.util.get_node_ip_address()
        self.proc = start_master_process(port, probe=self.ip)

    def address(self) -> str:
        if self.proc.poll() is not None:
            self.proc = start_master_process(self.port, probe=self.ip)
        return f"{self.ip}:{self.port}"


def ensure_local_master(port: int) -> str:
    """The address of the master omni_serve runs for this cluster, started on first use (needs Ray): on the head
    node when it is alive (it dies with the cluster, not with a worker node). Should its node die anyway, Ray
    restarts it elsewhere, empty: the Store's objects of requests in flight are lost, and clients set up
    against the old address fail their puts and gets until their replicas restart (name a master that outlives
    nodes with ``data_plane.mooncake.master_address`` for that)."""
    import ray

    from omni_serve.transport.directory import cluster_service_options

    holder = ray.remote(num_cpus=0, max_restarts=-1)(_MasterHolder).options(
        **cluster_service_options(MASTER_ACTOR)).remote(port)
    return ray.get(holder.address.remote(), timeout=60)
