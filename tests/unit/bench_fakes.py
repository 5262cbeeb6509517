"""Test support: a fake served engine for the bench runner's unit tests (no server, no HTTP)."""

from __future__ import annotations

from omni_serve.bench.records import RequestRecord, RunResult


def patch_engine_client(monkeypatch) -> None:
    """Make ``omni_serve.bench.client``'s load runs and warm-ups succeed instantly, every request 1 s long."""
    from omni_serve.bench import client

    async def fake_load(url, requests, model, point, **kw):
        return RunResult(label=kw["label"], system="engine", concurrency=point.concurrency, wall_s=1.0,
                         records=[RequestRecord(index=r.index, ok=True, e2e_s=1.0) for r in requests])

    async def fake_warmup(*a, **kw):
        return [RequestRecord(index=0, ok=True)]
    monkeypatch.setattr(client, "run_load", fake_load)
    monkeypatch.setattr(client, "warmup", fake_warmup)
