"""Metrics without Ray: request timing figures, the engine samples behind the stage gauges, the step hook,
data-plane transfer accounting, and that recording never fails a request."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_serve.engines.batch import BatchEngine
from omni_serve.metrics import IngressMetrics, RequestClock, StageMetrics, _Guarded, stage_sample
from omni_serve.transport import base
from tests.unit.test_autoscaling import FakeClock, _sleepy, _Work


def test_request_clock_figures():
    clock = FakeClock()
    rc = RequestClock(clock)
    clock.t += 0.5
    rc.text()
    clock.t += 0.1
    rc.audio(2.0)
    clock.t += 0.2
    rc.text()
    clock.t += 0.3
    rc.audio(2.0)
    clock.t += 0.4
    f = rc.figures()
    assert f["ttft"] == pytest.approx(0.5) and f["ttfp"] == pytest.approx(0.6)
    assert f["itl"] == pytest.approx([0.3]) and f["e2e"] == pytest.approx(1.5)
    assert f["rtf"] == pytest.approx(1.5 / 4.0)
    text_only = RequestClock(clock).figures()
    assert text_only["ttft"] is None and text_only["ttfp"] is None and text_only["rtf"] is None


def test_stage_sample_maps_engine_signals_to_gauges():
    ar = stage_sample({"queued": 2, "ready_waiting": 3, "waiting": 9, "active": 7, "utilization": 0.5,
                       "batch_occupancy": 0.25}, {"kv_blocks_used": 10, "kv_blocks_free": 90})
    assert ar == {"queue_length": 5, "active": 7, "utilization": 0.5, "batch_occupancy": 0.25,
                  "kv_blocks_used": 10.0, "kv_blocks_free": 90.0}
    dit = stage_sample({"diffusion_steps_in_flight": 40.0}, {})
    assert dit["diffusion_steps_in_flight"] == 40 and "kv_blocks_used" not in dit


def test_payload_nbytes_counts_tensors_arrays_and_bytes():
    payload = {"a": torch.zeros(4, 8), "b": [np.zeros(10, dtype=np.int16), b"xyz"], "c": 5, "d": "text"}
    assert base.payload_nbytes(payload) == 4 * 8 * 4 + 20 + 3


def test_observed_transfers_report_backend_bytes_and_latency():
    class Mem(base.Connector):
        name = "mem"

        def __init__(self):
            self.data = {}

        async def put(self, key, payload):
            self.data[key] = payload

        async def get(self, key, timeout):
            return self.data[key]

        async def free(self, key):
            self.data.pop(key, None)

        async def free_request(self, request_id):
            pass

        def sweep(self, now=None):
            return 0

        def stats(self):
            return {}

        def close(self):
            self.data.clear()

    seen = []
    previous = base.transfer_observer()
    base.set_transfer_observer(lambda *a: seen.append(a))
    try:
        async def main():
            conn = Mem()
            writer = base.ChunkWriter(conn, "r1", "e")
            await writer.write({"x": torch.ones(16), "end": True})
            return [c async for c in base.read_chunks(conn, "r1", "e", 1.0)]

        assert len(asyncio.run(main())) == 1
    finally:
        base.set_transfer_observer(previous)
    assert [(b, op, n) for b, op, n, _ in seen] == [("mem", "put", 64), ("mem", "get", 64)]
    assert all(s >= 0 for *_, s in seen)


def test_stage_metrics_hook_the_engine_steps_and_sample_it():
    async def main():
        engine = BatchEngine("code2wav", _sleepy(0.001), max_batch=4)
        metrics = StageMetrics("code2wav", engine, sample_s=3600)
        steps = []
        observe = metrics.step
        engine.on_step = lambda batch, seconds: (steps.append((batch, seconds)), observe(batch, seconds))
        await engine.start()
        await asyncio.gather(*(_collect(engine, f"r{i}") for i in range(3)))
        metrics.sample()  # through the real ray.serve.metrics (no-ops outside a cluster)
        metrics.close()
        await engine.cleanup()
        return steps

    steps = asyncio.run(main())
    assert steps and sum(b for b, _ in steps) == 3 * 5 and max(b for b, _ in steps) <= 4


async def _collect(engine, rid):
    return [x async for x in engine.generate(rid, _Work(5))]


def test_ingress_metrics_record_and_recording_failures_never_raise(caplog):
    m = IngressMetrics()
    rc = RequestClock()
    rc.text()
    m.finished("chat", rc)
    m.failed("chat", "invalid_request_error", "http_400")
    guarded = _Guarded("x")
    guarded.run(lambda: 1 / 0)
    guarded.run(lambda: 1 / 0)
    assert sum("recording failed" in r.message for r in caplog.records) == 1


def test_request_ids_carry_serves_id_safely_and_stay_unique():
    from omni_serve.request_ids import new_request_id

    a, b = new_request_id("chatcmpl", "client-42"), new_request_id("chatcmpl", "client-42")
    assert a.startswith("chatcmpl-client-42-") and b.startswith("chatcmpl-client-42-") and a != b
    hostile = new_request_id("img", "../../etc/passwd\n" + "x" * 200)
    assert "/" not in hostile and "\n" not in hostile and len(hostile) <= len("img-") + 64 + 9
    assert new_request_id("img", "").startswith("img-") and new_request_id("img").startswith("img-")


def test_the_committed_grafana_dashboard_is_current():
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "make_dashboard.py")
    spec = importlib.util.spec_from_file_location("make_dashboard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(module.OUT) as f:
        assert f.read() == module.render(), "run scripts/make_dashboard.py"
    exprs = [t["expr"] for p in module.dashboard()["panels"] for t in p["targets"]]
    assert all("ray_omni_serve_" in e for e in exprs)


def test_transfer_metrics_accept_payloads_without_tensor_bytes(caplog):
    from omni_serve.metrics import _TransferMetrics

    record = _TransferMetrics()  # the real ray.serve.metrics Counter, which refuses inc(0)
    record("ray", "put", 0, 0.001)
    record("ray", "put", 64, 0.001)
    assert not any("recording failed" in r.message for r in caplog.records)
