"""benchmarks/qwen2_5_omni/ceiling.py (the docs' Qwen2.5-Omni ceiling numbers) on the tiny checkpoint: every stage timed at
both batches through the served stages' own engines and chunking, the ceiling is the tightest bound (cores, or a
stage on its replicas), and a bench report's runs are set against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def test_ceiling_report_runs_and_sets_a_bench_run_against_it(omni_tiny_dir, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"label": "engine c=2", "throughput": {"requests_per_s": 1.0}},
                                          {"label": "hf", "throughput": {"requests_per_s": 0.5}}]}))
    out = tmp_path / "ceiling.json"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "qwen2_5_omni", "ceiling.py")
    subprocess.run([sys.executable, script, omni_tiny_dir, "--batch", "2", "--text-tokens", "4", "--codec-tokens",
                    "48", "--steps", "2", "--code2wav-replicas", "1", "--bench-report", str(bench), "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    costs = report["costs_s_per_request"]
    assert set(costs) == {"thinker", "talker", "code2wav"}
    assert all(set(by_batch) == {"1", "2"} and min(by_batch.values()) > 0 for by_batch in costs.values())
    best = report["best_s_per_request"]
    ceiling = min(2 / sum(best.values()), *(1 / cost for cost in best.values()))
    assert report["ceiling_req_per_s"] == pytest.approx(ceiling)
    assert report["bench"]["engine c=2"]["measured_over_ceiling"] == pytest.approx(1.0 / ceiling)
    assert report["bench"]["ceiling_over_hf"] == pytest.approx(ceiling / 0.5)
