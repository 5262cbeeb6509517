"""``omni-serve bench transport``: data-plane bandwidth and latency per backend vs memcpy, in one run.

Contract: ``run_transport_bench(TransportBenchConfig)`` starts a local Ray (unless one is up, or ``address``
names a cluster to join), places a producer and a consumer actor (two processes on this node, or on the nodes
whose IPs ``producer_node`` and ``consumer_node`` name: two nodes measure the cross-node path, e.g. on the
multi-node harness, docs/multinode.md), and for every backend and payload size moves
``reps`` payloads (one float32 tensor of that size, after ``warmup`` unmeasured ones) from the producer to
the consumer, one at a time:

- ``put_s``: the producer's ``connector.put`` (it returns once the payload is published);
- ``get_s``: the consumer's ``connector.get`` of the published key plus a read of one float per 4 KiB page
  (the payload is really there and mapped; zero-copy backends do not copy it) and ``free``;
- ``transfer_s = put_s + get_s`` per payload; bandwidth = size / median transfer time.

The baseline is ``torch`` ``copy_`` of a tensor of the same size in the producer's process (median of the
same number of reps), so ``vs_memcpy`` = backend bandwidth / memcpy bandwidth on the same machine in the
same run. Writes ``transport_bench_report.json`` to ``out`` and returns the report (also printed).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid
from typing import Any

from pydantic import BaseModel, Field

from omni_serve.bench.report import _num, _table

SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20, "64MiB": 64 << 20, "512MiB": 512 << 20}
PAGE_FLOATS = 1024  # floats per 4 KiB page


def _served_backends() -> list[str]:
    from omni_serve.transport.registry import AUTO, served_connectors

    return [AUTO, *served_connectors()]


class TransportBenchConfig(BaseModel):
    backends: list[str] = Field(default_factory=_served_backends, description=(
        "Connectors to measure (names of the connector registry; default: 'auto' and every registered one that "
        "crosses processes). 'auto', the edges' default, is reported with the backend it chose."))
    sizes: list[str] = Field(default_factory=lambda: ["4KiB", "1MiB", "64MiB", "512MiB"],
                             description="Payload sizes (keys of SIZES).")
    reps: int = Field(0, ge=0, description="Measured payloads per size (0: 50 for <=1 MiB, 10 for 64 MiB, 4 above).")
    warmup: int = Field(2, ge=0, description="Unmeasured payloads first (pools, mappings, connections).")
    out: str = Field("bench_transport", description="Directory of transport_bench_report.json.")
    address: str | None = Field(None, description="Ray cluster to join ('host:port'); None: local Ray.")
    producer_node: str | None = Field(None, description="IP of the node the producer runs on (None: any).")
    consumer_node: str | None = Field(None, description="IP of the node the consumer runs on (None: any).")


def reps_for(nbytes: int, reps: int) -> int:
    if reps:
        return reps
    return 50 if nbytes <= 1 << 20 else 10 if nbytes <= 64 << 20 else 4


class _Endpoint:
    """One side of the measurement (a Ray actor): holds the connectors of its process, with buffers sized
    for the largest payload (the Mooncake registered buffer and Store segment must hold one)."""

    def __init__(self, max_bytes: int):
        import torch

        from omni_serve.transport.config import DataPlaneSpec

        torch.set_num_threads(1)
        self.payloads: dict[int, Any] = {}
        room = max(2 * max_bytes + (64 << 20), 256 << 20)
        self.spec = DataPlaneSpec.model_validate({"mooncake": {"buffer_bytes": room, "global_segment_bytes": room}})

    def _connector(self, backend: str):
        from omni_serve.transport.connectors import get_connector

        return get_connector(backend, self.spec)

    async def put(self, backend: str, key: str, nbytes: int) -> float:
        import torch

        payload = self.payloads.get(nbytes)
        if payload is None:
            payload = self.payloads[nbytes] = torch.rand(nbytes // 4)
        conn = self._connector(backend)
        t0 = time.perf_counter()
        await conn.put(key, {"x": payload})
        return time.perf_counter() - t0

    async def get(self, backend: str, key: str) -> float:
        conn = self._connector(backend)
        t0 = time.perf_counter()
        out = await conn.get(key, 60)
        x = out["x"]
        float(x[::PAGE_FLOATS].sum())  # every page is there
        await conn.free(key)
        elapsed = time.perf_counter() - t0
        del out, x
        return elapsed

    def memcpy(self, nbytes: int, reps: int) -> float:
        import torch

        src = torch.rand(nbytes // 4)
        dst = torch.empty_like(src)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def resolved(self, backend: str) -> str:
        from omni_serve.transport.auto import resolve

        return resolve(backend, self.spec)

    def stats(self, backend: str) -> dict:
        return self._connector(backend).stats()

    def expect(self, backend: str, request_id: str, edge: str) -> None:
        """The consumer says where it reads, as a stage does when its call starts (``nearest`` routes by it)."""
        self._connector(backend).expect(request_id, edge)

    def where(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


def _measure(producer, consumer, backend: str, nbytes: int, reps: int, warmup: int) -> dict[str, Any]:
    import ray

    puts, gets = [], []
    run_id = uuid.uuid4().hex[:8]
    ray.get(consumer.expect.remote(backend, f"bench-{run_id}", backend))
    for i in range(warmup + reps):
        key = f"bench-{run_id}/{backend}/{i}"
        put_s = ray.get(producer.put.remote(backend, key, nbytes))
        get_s = ray.get(consumer.get.remote(backend, key))
        if i >= warmup:
            puts.append(put_s)
            gets.append(get_s)
    transfer = [p + g for p, g in zip(puts, gets)]
    med = statistics.median(transfer)
    return {"put_ms": 1e3 * statistics.median(puts), "get_ms": 1e3 * statistics.median(gets),
            "transfer_ms": 1e3 * med, "p90_transfer_ms": 1e3 * sorted(transfer)[int(0.9 * (len(transfer) - 1))],
            "gb_per_s": nbytes / med / 1e9, "reps": reps}


def _on_node(ip: str | None) -> dict[str, Any]:
    """Actor options that pin it to the alive node with IP ``ip`` (none: anywhere)."""
    if ip is None:
        return {}
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    for node in ray.nodes():
        if node.get("Alive") and node["NodeManagerAddress"] == ip:
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)}
    raise ValueError(f"no alive Ray node has IP {ip}")


def run_transport_bench(cfg: TransportBenchConfig) -> dict[str, Any]:
    import ray

    unknown = [s for s in cfg.sizes if s not in SIZES]
    if unknown:
        raise ValueError(f"unknown sizes {unknown}; known: {list(SIZES)}")
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if cfg.address:
            ray.init(address=cfg.address, log_to_driver=False)
        else:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        Endpoint = ray.remote(num_cpus=0)(_Endpoint)
        max_bytes = max(SIZES[s] for s in cfg.sizes)
        producer = Endpoint.options(**_on_node(cfg.producer_node)).remote(max_bytes)
        consumer = Endpoint.options(**_on_node(cfg.consumer_node)).remote(max_bytes)
        report: dict[str, Any] = {"created": time.time(), "config": cfg.model_dump(), "memcpy": {}, "backends": {},
                                  "nodes": {"producer": ray.get(producer.where.remote()),
                                            "consumer": ray.get(consumer.where.remote())}}
        print(f"producer on {report['nodes']['producer']}, consumer on {report['nodes']['consumer']}", flush=True)
        for size in cfg.sizes:
            nbytes = SIZES[size]
            reps = reps_for(nbytes, cfg.reps)
            t = ray.get(producer.memcpy.remote(nbytes, reps))
            report["memcpy"][size] = {"transfer_ms": 1e3 * t, "gb_per_s": nbytes / t / 1e9}
        for backend in cfg.backends:
            rows: dict[str, Any] = {}
            for size in cfg.sizes:
                nbytes = SIZES[size]
                try:
                    row = _measure(producer, consumer, backend, nbytes, reps_for(nbytes, cfg.reps), cfg.warmup)
                    row["vs_memcpy"] = row["gb_per_s"] / report["memcpy"][size]["gb_per_s"]
                except Exception as exc:  # noqa: BLE001 - reported per backend, the others still run
                    row = {"error": str(exc).strip().splitlines()[-1][:300]}
                rows[size] = row
                print(f"  {backend:15s} {size:>7s}: " + (
                    f"{row['gb_per_s']:.2f} GB/s ({row['vs_memcpy']:.0%} of memcpy)" if "error" not in row
                    else f"error: {row['error']}"), flush=True)
            chosen = ray.get(producer.resolved.remote(backend))
            report["backends"][backend if chosen == backend else f"{backend} ({chosen})"] = rows
        os.makedirs(cfg.out, exist_ok=True)
        path = os.path.join(cfg.out, "transport_bench_report.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        report["path"] = path
        print(format_transport_table(report))
        return report
    finally:
        if started:
            ray.shutdown()


def format_transport_table(report: dict[str, Any]) -> str:
    sizes = list(report["memcpy"])
    header = ["backend", *[f"{s} ms" for s in sizes], *[f"{s} GB/s" for s in sizes], *[f"{s} vs memcpy" for s in sizes]]
    rows = [["memcpy", *[_num(report["memcpy"][s]["transfer_ms"], "{:.3f}") for s in sizes],
             *[_num(report["memcpy"][s]["gb_per_s"]) for s in sizes], *["1.00" for _ in sizes]]]
    for backend, per in report["backends"].items():
        rows.append([backend, *[_num(per[s].get("transfer_ms"), "{:.3f}") for s in sizes],
                     *[_num(per[s].get("gb_per_s")) for s in sizes],
                     *[_num(per[s].get("vs_memcpy")) for s in sizes]])
    return ("Data-plane transfer (put + get of one payload, median) vs memcpy of the same size\n"
            + _table(header, rows))
