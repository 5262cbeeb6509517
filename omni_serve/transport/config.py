"""Settings of the data-plane backends, one model per backend, grouped in a graph's ``data_plane`` field.

Contract: a graph spec has ``data_plane: DataPlaneSpec``; ``get_connector(name, spec.data_plane)`` builds
the process-wide connector of a backend from its section the first time a process uses it (every process
of one graph gets the same settings, since they all validate the same spec). Which edge uses which backend
is the edge's ``connector`` field, not this.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ShmSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dir: str | None = Field(None, description=(
        "tmpfs directory of the segments (default: OMNI_SERVE_SHM_DIR or /dev/shm). Every process of a "
        "node must see the same directory."))
    pool_bytes: int | None = Field(None, ge=1 << 20, description=(
        "Bytes of segments one producing process may hold (unread payloads + free pool); default "
        "OMNI_SERVE_SHM_POOL_BYTES or 4 GiB. A put waits for space, then fails with a clear error."))


class MooncakeSpec(BaseModel):
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
        "Mooncake Store master 'host:port'. None: omni_serve starts a local mooncake_master on first use "
        "(single node, local runs)."))
    global_segment_bytes: int = Field(512 << 20, ge=1 << 20, description=(
        "Memory each process contributes to the Mooncake Store's distributed pool."))
    local_buffer_bytes: int = Field(64 << 20, ge=1 << 20, description=(
        "Mooncake Store client's own transfer buffer per process (its non-zero-copy calls)."))
    master_port: int = Field(50051, ge=1, le=65535, description=(
        "RPC port of the local master omni_serve starts when master_address is None."))


class DataPlaneSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shm: ShmSpec = Field(default_factory=ShmSpec, description="Shared-memory connector settings.")
    mooncake: MooncakeSpec = Field(default_factory=MooncakeSpec, description=(
        "Mooncake Transfer Engine and Store connector settings."))

    def section(self, connector: str) -> BaseModel | None:
        """The settings of a connector name ('mooncake_store' shares the 'mooncake' section)."""
        return getattr(self, connector.removesuffix("_store"), None)
