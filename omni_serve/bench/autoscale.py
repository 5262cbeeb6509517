"""Drive a served graph into a one-stage bottleneck and record how Ray Serve scales each stage.

Contract: ``run_wave(WaveConfig)`` keeps ``concurrency`` chat requests in flight against ``url`` for
``load_s`` seconds (closed loop; with ``stop_at``, until every stage it names runs that many replicas, then
``hold_s`` more, ``load_s`` at most), then stops sending and keeps watching until every watched stage is back
at ``settle_replicas`` (or ``max_idle_s`` passes). Every ``poll_s`` it records, per stage, the replicas
Serve runs and its target (the Serve REST API of the cluster's dashboard, what ``serve status`` shows)
and the engine load the stage reports (``/health``). Returns a ``Wave``: the timeline, every request's
outcome, and the phases' times. Nothing here asserts: the integration test and the CLI read the Wave.

    python -m omni_serve.bench.autoscale --url http://127.0.0.1:8000 --dashboard http://127.0.0.1:8265 \\
        --app qwen2_5_omni --load-s 60 --concurrency 8 --out autoscale.json
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

log = logging.getLogger(__name__)

DEFAULT_REQUEST = {
    "model": "qwen2.5-omni", "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"},
    "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
    "max_tokens": 24, "min_tokens": 24, "temperature": 0,
}


@dataclass
class WaveConfig:
    url: str
    dashboard: str
    app: str
    load_s: float = 60.0
    concurrency: int = 8
    stop_at: dict[str, int] = field(default_factory=dict)  # stage -> RUNNING replicas that end the load early
    hold_s: float = 5.0  # load kept on this long after stop_at was reached
    max_idle_s: float = 180.0
    poll_s: float = 1.0
    settle_replicas: int = 1
    request: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_REQUEST))
    request_timeout_s: float = 300.0


@dataclass
class Sample:
    t: float
    replicas: dict[str, int]  # RUNNING replicas per deployment
    targets: dict[str, int]  # Serve's target per deployment
    load: dict[str, float]  # engine ``load`` per stage (one replica's, the one /health reached)


@dataclass
class Wave:
    samples: list[Sample]
    outcomes: list[int]  # HTTP status per request (0: transport error)
    errors: list[str]
    load_end_t: float
    end_t: float

    def first_t(self, stage: str, replicas: int, after: float = 0.0) -> float | None:
        return next((s.t for s in self.samples if s.t >= after and s.replicas.get(stage) == replicas), None)

    def table(self, stages: list[str]) -> str:
        head = "t(s)  " + "  ".join(f"{s:>16}" for s in stages)
        rows = [head, "      " + "  ".join(f"{'run/target load':>16}" for _ in stages)]
        marked = False
        for s in self.samples:
            cells = [f"{s.replicas.get(st, 0)}/{s.targets.get(st, 0)} {s.load.get(st, float('nan')):5.2f}"
                     for st in stages]
            mark = ""
            if not marked and s.t >= self.load_end_t:
                mark, marked = "  <- load stopped", True
            rows.append(f"{s.t:5.1f} " + "  ".join(f"{c:>16}" for c in cells) + mark)
        return "\n".join(rows)


def serve_replicas(dashboard: str, app: str, client: httpx.Client) -> tuple[dict[str, int], dict[str, int]]:
    """(RUNNING replicas, target replicas) per deployment of ``app``, from the Serve REST API."""
    details = client.get(f"{dashboard}/api/serve/applications/", timeout=10).json()
    deployments = details["applications"][app]["deployments"]
    running = {name: sum(r["state"] == "RUNNING" for r in d.get("replicas", [])) for name, d in deployments.items()}
    targets = {name: int(d.get("target_num_replicas", 0)) for name, d in deployments.items()}
    return running, targets


def _stage_load(url: str, client: httpx.Client) -> dict[str, float]:
    try:
        stages = client.get(f"{url}/health", timeout=10).json()["stages"]
    except (httpx.HTTPError, ValueError, KeyError):
        return {}
    return {name: float(info.get("load", {}).get("load", float("nan"))) for name, info in stages.items()}


def run_wave(cfg: WaveConfig) -> Wave:
    samples: list[Sample] = []
    outcomes: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    load_end = t0 + cfg.load_s  # moved earlier (once) when stop_at is reached
    reached = False

    def client_loop() -> None:
        with httpx.Client(timeout=cfg.request_timeout_s) as client:
            while time.monotonic() < load_end:
                try:
                    r = client.post(f"{cfg.url}/v1/chat/completions", json=cfg.request)
                    status, err = r.status_code, (None if r.status_code == 200 else r.text[:300])
                except httpx.HTTPError as exc:
                    status, err = 0, repr(exc)
                with lock:
                    outcomes.append(status)
                    if err:
                        errors.append(err)

    pool = ThreadPoolExecutor(cfg.concurrency)
    clients = [pool.submit(client_loop) for _ in range(cfg.concurrency)]
    log.info("autoscale wave: %d clients for %.0f s against %s", cfg.concurrency, cfg.load_s, cfg.url)
    with httpx.Client() as watcher:
        while True:
            now = time.monotonic()
            try:
                running, targets = serve_replicas(cfg.dashboard, cfg.app, watcher)
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                log.warning("serve status unavailable: %r", exc)
                running, targets = {}, {}
            samples.append(Sample(round(now - t0, 2), running, targets, _stage_load(cfg.url, watcher)))
            log.info("t=%5.1f replicas %s", now - t0, running)
            if (cfg.stop_at and not reached and now < load_end
                    and all(running.get(stage, 0) >= n for stage, n in cfg.stop_at.items())):
                reached, load_end = True, min(load_end, now + cfg.hold_s)
                log.info("t=%5.1f %s reached: the load stops in %.0f s", now - t0, cfg.stop_at, cfg.hold_s)
            loading = now < load_end or not all(c.done() for c in clients)
            settled = running and all(n <= cfg.settle_replicas for n in running.values())
            if not loading and (settled or now - load_end > cfg.max_idle_s):
                break
            time.sleep(cfg.poll_s)
    pool.shutdown(wait=True)
    return Wave(samples, outcomes, errors, round(load_end - t0, 2), round(time.monotonic() - t0, 2))


def _stop_at(text: str) -> dict[str, int]:
    """``--stop-at``: ``code2wav=2,talker=2`` -> {"code2wav": 2, "talker": 2}."""
    out = {}
    for item in filter(None, text.split(",")):
        stage, _, n = item.partition("=")
        if not stage or not n.isdigit() or int(n) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: expected STAGE=N with N >= 1")
        out[stage] = int(n)
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="Serve HTTP base URL of the graph")
    p.add_argument("--dashboard", required=True, help="Ray dashboard URL (Serve REST API)")
    p.add_argument("--app", required=True, help="Serve application name")
    p.add_argument("--load-s", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-idle-s", type=float, default=180.0)
    p.add_argument("--stop-at", type=_stop_at, default={}, metavar="STAGE=N[,STAGE=N]",
                   help="end the load early, --hold-s after every named stage runs N replicas")
    p.add_argument("--hold-s", type=float, default=5.0)
    p.add_argument("--out", default=None, help="write the wave as JSON here")
    a = p.parse_args(argv)
    wave = run_wave(WaveConfig(url=a.url, dashboard=a.dashboard, app=a.app, load_s=a.load_s,
                               concurrency=a.concurrency, max_idle_s=a.max_idle_s, hold_s=a.hold_s,
                               stop_at=a.stop_at))
    stages = sorted({k for s in wave.samples for k in s.replicas})
    print(wave.table(stages))
    ok = sum(s == 200 for s in wave.outcomes)
    print(f"requests: {len(wave.outcomes)}, succeeded: {ok}, failed: {len(wave.outcomes) - ok}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(asdict(wave), f, indent=1)
    return 0 if ok == len(wave.outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
