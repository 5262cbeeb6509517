"""``scripts/gpu_check.sh --dry-run``: the GPU check a session with a lent GPU runs, run here on CPU so that it never
rots: the gpu-marked tests are collected (they import without CUDA and without Ray), a DiT step and an AR decode
step are timed at two batch sizes on tiny generated checkpoints, and the JSON report says so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO


def test_the_gpu_check_dry_run_writes_its_report(tmp_path):
    proc = subprocess.run([os.path.join(REPO, "scripts", "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["device"] == "cpu" and report["batches"] == [1, 2]
    tests = report["tests"]
    assert tests["exit_code"] == 0 and tests["collected"] >= 3, tests  # every gpu test imports here
    assert "tests/unit/test_gpu_engines.py" in tests["command"] and "--collect-only" in tests["command"]
    for timing in ("dit_step_ms", "ar_decode_step_ms"):
        assert set(report[timing]) == {"1", "2"} and all(isinstance(v, float) for v in report[timing].values()), \
            report[timing]
    assert report["ar_decode_step_ms"]["1"] > 0
    assert report["ray_imported"] is False  # the GPU machine has no Ray
