#!/usr/bin/env python3
"""Soak: steady load on a running omni_serve graph for N minutes, reporting memory over time.

    make run &                                       # or any omni-serve deployment on this machine
    .venv/bin/python benchmarks/tools/soak.py --url http://127.0.0.1:8000 --minutes 10 --out soak_out

``--concurrency`` clients send speech requests back to back (closed loop), alternating streaming and
non-streaming. A 429/503 answer with ``Retry-After`` counts as *rejected* (the overload answer), not failed;
the client then waits ``--retry-wait`` seconds (default: what ``Retry-After`` says; 0 keeps hammering, the
overload scenario: offered load far above what the ingress admits). Every ``--interval`` seconds
the script samples, on this node:
- the RSS of every Serve replica process, summed per deployment (``ray::ServeReplica:<app>:<deployment>``);
- the Ray object store's use (``ray memory --stats-only``, read through Ray's internal API, with the
  cluster found as ``address="auto"``);
- the shared-memory connector's bytes under /dev/shm.
It reports requests completed and failed, and the growth of each figure from the end of the warm-up to the
end of the run: the mean of the first three samples after ``--warmup-minutes`` against the mean of the
last three. It also reports the latency of completed requests (p50/p99 of each minute). Results go to
``<out>/soak.json`` and to a table on stdout. The exit status is 1 when a request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

REQUEST = {"model": "qwen2.5-omni", "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "wav"},
           "messages": [{"role": "user", "content": "Tell me about the weather today."}],
           "max_tokens": 16, "min_tokens": 16, "temperature": 0.7}
REPLICA = re.compile(r"^ray::ServeReplica:([^:]+):([^.\s]+)")


def replica_rss_mib() -> dict[str, float]:
    """RSS per deployment (MiB) of this node's Serve replica processes."""
    out: dict[str, float] = defaultdict(float)
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        m = REPLICA.match(cmd)
        if m and proc.info["memory_info"] is not None:
            out[f"{m.group(1)}:{m.group(2)}"] += proc.info["memory_info"].rss / 2**20
    return dict(out)


def object_store_mib() -> float | None:
    try:
        from ray._private.internal_api import memory_summary

        text = memory_summary(stats_only=True)
    except Exception:  # noqa: BLE001 - reported as unknown
        return None
    m = re.search(r"Plasma memory usage (\d+(?:\.\d+)?) MiB", text)
    return float(m.group(1)) if m else 0.0


def shm_mib() -> float:
    total = 0
    for root, _, files in os.walk("/dev/shm"):
        if "omni_serve" not in root:
            continue
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total / 2**20


def latency_per_minute(latencies: list[tuple[float, float]]) -> list[dict]:
    by_minute: dict[int, list[float]] = defaultdict(list)
    for at, seconds in latencies:
        by_minute[int(at // 60)].append(seconds)
    rows = []
    for minute, values in sorted(by_minute.items()):
        values.sort()
        rows.append({"minute": minute, "completed": len(values), "p50": values[len(values) // 2],
                     "p99": values[min(len(values) - 1, int(len(values) * 0.99))]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--retry-wait", type=float, default=None,
                   help="seconds a rejected client waits (default: the answer's Retry-After)")
    p.add_argument("--max-tokens", type=int, default=REQUEST["max_tokens"], help="text tokens per request")
    p.add_argument("--out", default="soak_out")
    a = p.parse_args()

    import ray

    ray.init(address="auto", log_to_driver=False)
    counts = {"ok": 0, "failed": 0, "rejected": 0}
    errors: list[str] = []
    latencies: list[tuple[float, float]] = []  # (finished at, seconds) of completed requests
    lock = threading.Lock()
    stop_at = time.monotonic() + a.minutes * 60
    request = REQUEST | {"max_tokens": a.max_tokens, "min_tokens": a.max_tokens}

    def one(http: httpx.Client, stream: bool) -> tuple[str, str, float]:
        """(outcome, error text, seconds to wait before the next request)."""
        if not stream:
            r = http.post(f"{a.url}/v1/chat/completions", json=request)
            body = r.text
        else:
            with http.stream("POST", f"{a.url}/v1/chat/completions", json=request | {"stream": True}) as r:
                body = "".join(r.iter_text())
        if r.status_code in (429, 503) and "retry-after" in r.headers:
            wait = float(r.headers["retry-after"]) if a.retry_wait is None else a.retry_wait
            return "rejected", "", wait
        if r.status_code != 200 or (stream and ('"error"' in body or not body.rstrip().endswith("[DONE]"))):
            return "failed", f"{r.status_code} {body[:200]}", 0.0
        return "ok", "", 0.0

    def client(index: int) -> None:
        with httpx.Client(timeout=300) as http:
            n = 0
            while time.monotonic() < stop_at:
                start = time.monotonic()
                try:
                    outcome, err, wait = one(http, stream=(index + n) % 2 == 1)
                except httpx.HTTPError as exc:
                    outcome, err, wait = "failed", repr(exc), 0.0
                n += 1
                with lock:
                    counts[outcome] += 1
                    if err:
                        errors.append(err)
                    if outcome == "ok":
                        now = time.monotonic()
                        latencies.append((now - t0, now - start))
                if wait:
                    time.sleep(wait)

    samples = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(a.concurrency) as pool:
        for i in range(a.concurrency):
            pool.submit(client, i)
        while time.monotonic() < stop_at:
            rss = replica_rss_mib()
            sample = {"t_s": round(time.monotonic() - t0, 1), "requests_ok": counts["ok"],
                      "requests_failed": counts["failed"], "requests_rejected": counts["rejected"],
                      "rss_mib": {k: round(v, 1) for k, v in rss.items()},
                      "rss_total_mib": round(sum(rss.values()), 1), "object_store_mib": object_store_mib(),
                      "shm_mib": round(shm_mib(), 1)}
            samples.append(sample)
            print(f"t={sample['t_s']:6.0f}s ok={sample['requests_ok']:5d} failed={sample['requests_failed']} "
                  f"rejected={sample['requests_rejected']:6d} rss={sample['rss_total_mib']:8.1f} MiB "
                  f"object_store={sample['object_store_mib']} MiB shm={sample['shm_mib']} MiB", flush=True)
            time.sleep(a.interval)

    after = [s for s in samples if s["t_s"] >= a.warmup_minutes * 60]
    report = {"config": vars(a), "requests": counts, "errors": errors[:20], "samples": samples,
              "latency_s_per_minute": latency_per_minute(latencies)}
    for row in report["latency_s_per_minute"]:
        print(f"minute {row['minute']:3d}: {row['completed']:4d} completed, p50 {row['p50']:.2f} s, "
              f"p99 {row['p99']:.2f} s")
    if len(after) >= 6:
        def growth(key):
            first = [s[key] for s in after[:3] if s[key] is not None]
            last = [s[key] for s in after[-3:] if s[key] is not None]
            if not first or not last or statistics.mean(first) == 0:
                return None
            return (statistics.mean(last) - statistics.mean(first)) / statistics.mean(first)

        report["growth_after_warmup"] = {k: growth(k) for k in ("rss_total_mib", "object_store_mib", "shm_mib")}
        per = {}
        for name in after[0]["rss_mib"]:
            first = statistics.mean(s["rss_mib"].get(name, 0) for s in after[:3])
            last = statistics.mean(s["rss_mib"].get(name, 0) for s in after[-3:])
            per[name] = (last - first) / first if first else None
        report["rss_growth_per_deployment"] = per
        print("growth after warm-up:", json.dumps(report["growth_after_warmup"]))
        print("RSS growth per deployment:", json.dumps({k: round(v, 4) for k, v in per.items() if v is not None}))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"requests: {counts['ok']} ok, {counts['rejected']} rejected (429/503), {counts['failed']} failed; "
          f"wrote {a.out}/soak.json")
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
