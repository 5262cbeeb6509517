"""``omni-serve bench``: argument handling, config validation and a text-mode run on the tiny checkpoint (no Ray)."""

from __future__ import annotations

import json
import os

import pytest
from pydantic import ValidationError

from omni_serve.bench.runner import BenchConfig
from omni_serve.cli import main


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--url", "--checkpoint", "--num-requests", "--concurrency", "--request-rate", "--max-tokens",
                 "--no-audio", "--baseline", "--mode", "--out"):
        assert flag in text


def test_bad_lists_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--url", "http://x", "--concurrency", "1,zero"])
    with pytest.raises(SystemExit):
        main(["bench", "--url", "http://x", "--request-rate", "0"])


def test_config_validation(capsys):
    assert main(["bench", "--mode", "omni"]) == 2  # no --url
    assert "needs --url" in capsys.readouterr().err
    assert main(["bench", "--url", "http://x", "--baseline", "hf"]) == 2  # baseline without checkpoint
    with pytest.raises(ValidationError, match="text only"):
        BenchConfig(url="http://x", checkpoint="ckpt", baselines=["cb"], audio=True)
    with pytest.raises(ValidationError, match="text mode needs --checkpoint"):
        BenchConfig(mode="text")


def test_load_points():
    closed = BenchConfig(url="http://x", concurrency=[1, 4, 16]).points()
    assert [(p.concurrency, p.request_rate) for p in closed] == [(1, None), (4, None), (16, None)]
    open_loop = BenchConfig(url="http://x", request_rate=[0.5, 2]).points()
    assert [(p.concurrency, p.request_rate) for p in open_loop] == [(None, 0.5), (None, 2)]
    capped = BenchConfig(url="http://x", request_rate=[2], concurrency=[8], concurrency_given=True).points()
    assert [(p.concurrency, p.request_rate) for p in capped] == [(8, 2)]


def test_text_mode_compares_engine_with_cb(omni_tiny_dir, tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--mode", "text", "--checkpoint", omni_tiny_dir, "--num-requests", "3", "--concurrency", "1,2",
               "--max-tokens", "4", "--max-words", "8", "--progress-every", "0", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "cb c=1" in printed and "engine_text c=2" in printed
    assert f"wrote {os.path.join(str(out), 'bench_report.json')}" in printed
    report = json.loads((out / "bench_report.json").read_text())
    assert [r["label"] for r in report["runs"]] == ["engine_text c=1", "engine_text c=2", "cb c=1", "cb c=2"]
    assert all(r["num_ok"] == 3 and r["num_errors"] == 0 for r in report["runs"])
    assert report["comparisons"]
    assert report["config"]["mode"] == "text" and report["config"]["baselines"] == ["cb"]
    assert (out / "bench_report.png").stat().st_size > 0
