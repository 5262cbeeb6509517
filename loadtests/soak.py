#!/usr/bin/env python3
"""Soak: steady load on a running omni_serve graph for N minutes, reporting memory over time.

    make run &                                       # or any omni-serve deployment on this machine
    .venv/bin/python loadtests/soak.py --url http://127.0.0.1:8000 --minutes 10 --out soak_out

``--concurrency`` clients send speech requests back to back (closed loop). Every ``--interval`` seconds
the script samples, on this node:
- the RSS of every Serve replica process, summed per deployment (``ray::ServeReplica:<app>:<deployment>``);
- the Ray object store's use (``ray memory --stats-only``, read through Ray's internal API, with the
  cluster found as ``address="auto"``);
- the shared-memory connector's bytes under /dev/shm.
It reports requests completed and failed, and the growth of each figure from the end of the warm-up to the
end of the run: the mean of the first three samples after ``--warmup-minutes`` against the mean of the
last three. Results go to ``<out>/soak.json`` and to a table on stdout. The exit status is 1 when a
request failed.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-minutes", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--out", default="soak_out")
    a = p.parse_args()

    import ray

    ray.init(address="auto", log_to_driver=False)
    counts = {"ok": 0, "failed": 0}
    errors: list[str] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + a.minutes * 60

    def client() -> None:
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < stop_at:
                try:
                    r = http.post(f"{a.url}/v1/chat/completions", json=REQUEST)
                    ok, err = r.status_code == 200, f"{r.status_code} {r.text[:200]}"
                except httpx.HTTPError as exc:
                    ok, err = False, repr(exc)
                with lock:
                    counts["ok" if ok else "failed"] += 1
                    if not ok:
                        errors.append(err)

    samples = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(a.concurrency) as pool:
        for _ in range(a.concurrency):
            pool.submit(client)
        while time.monotonic() < stop_at:
            rss = replica_rss_mib()
            sample = {"t_s": round(time.monotonic() - t0, 1), "requests_ok": counts["ok"],
                      "requests_failed": counts["failed"], "rss_mib": {k: round(v, 1) for k, v in rss.items()},
                      "rss_total_mib": round(sum(rss.values()), 1), "object_store_mib": object_store_mib(),
                      "shm_mib": round(shm_mib(), 1)}
            samples.append(sample)
            print(f"t={sample['t_s']:6.0f}s ok={sample['requests_ok']:5d} failed={sample['requests_failed']} "
                  f"rss={sample['rss_total_mib']:8.1f} MiB object_store={sample['object_store_mib']} MiB "
                  f"shm={sample['shm_mib']} MiB", flush=True)
            time.sleep(a.interval)

    after = [s for s in samples if s["t_s"] >= a.warmup_minutes * 60]
    report = {"config": vars(a), "requests": counts, "errors": errors[:20], "samples": samples}
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
    print(f"requests: {counts['ok']} ok, {counts['failed']} failed; wrote {a.out}/soak.json")
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
