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
    # a chosen concurrency: its closed-loop points, then the open-loop ones capped by the largest
    both = BenchConfig(url="http://x", request_rate=[2], concurrency=[1, 8], concurrency_given=True).points()
    assert [(p.concurrency, p.request_rate) for p in both] == [(1, None), (8, None), (8, 2)]


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


# --------------------------------------------------------------------------- the bench registry


@pytest.fixture
def toy_registered(monkeypatch):
    """The toy family and its bench, each through its entry-point group: no edit of omni_serve or benchmarks/."""
    import importlib.metadata

    from omni_serve.bench import plugins
    from omni_serve.graph import registry

    toys = {registry.ENTRY_POINT_GROUP: importlib.metadata.EntryPoint("toy", "tests.toy_family:FAMILY",
                                                                      registry.ENTRY_POINT_GROUP),
            plugins.ENTRY_POINT_GROUP: importlib.metadata.EntryPoint("toy", "tests.toy_family.bench:BENCH",
                                                                     plugins.ENTRY_POINT_GROUP)}
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [toys[group]] if group in toys else real(group=group, **kw))
    registry.families.cache_clear()
    plugins.benches.cache_clear()
    yield
    registry.families.cache_clear()
    plugins.benches.cache_clear()


def test_a_toy_family_bench_is_listed_parsed_and_run_through_the_registry(toy_registered, capsys):
    from omni_serve.bench import plugins

    assert {"toy", "qwen2_5_omni", "qwen_image"} <= set(plugins.benches()) and "echo" in plugins.modes()
    with pytest.raises(SystemExit):
        main(["bench", "--graph", "toy", "--help"])
    text = capsys.readouterr().out
    assert "--echo-words" in text and "echo: send words, read them back" in text and "--max-tokens T" not in text
    assert main(["bench", "--graph", "toy", "--url", "http://x", "--echo-words", "5", "--concurrency", "1,2"]) == 0
    assert "toy bench echo of toy: 5 words to http://x, c=[1, 2]" in capsys.readouterr().out
    assert main(["bench", "--mode", "echo", "--url", "http://y"]) == 0  # the only bench with that mode
    assert "toy bench echo of toy: 3 words to http://y" in capsys.readouterr().out
    assert main(["bench", "--graph", "toy", "--mode", "omni", "--url", "http://x"]) == 2
    assert "the toy bench has no mode 'omni'; its modes: echo" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the flag is the toy's: another family's bench does not know it
        main(["bench", "--url", "http://x", "--echo-words", "5"])


def test_without_graph_the_checkpoint_or_the_mode_picks_the_bench(tmp_path):
    from omni_serve.bench.plugins import resolve

    assert resolve(None, None).family == "qwen2_5_omni"
    assert resolve(None, "image").family == "qwen_image" and resolve(None, "text").family == "qwen2_5_omni"
    for family in ("glm_image", "qwen_image_edit", "qwen3_omni"):
        (tmp_path / family).mkdir()
        (tmp_path / family / "omni_serve_checkpoint.json").write_text(json.dumps({"family": family}))
    assert resolve(None, "image", str(tmp_path / "glm_image")).family == "glm_image"
    assert resolve(None, "image", str(tmp_path / "qwen_image_edit")).family == "qwen_image_edit"
    assert resolve(None, "speech", str(tmp_path / "qwen3_omni")).family == "qwen3_omni"
    assert resolve(None, "text", str(tmp_path / "qwen3_omni")).family == "qwen2_5_omni"  # qwen3 has no text mode
    assert resolve("qwen3_omni", None).family == "qwen3_omni"
    with pytest.raises(ValueError, match="no bench for graph 'nope'"):
        resolve("nope", None)


def test_qwen3_runs_omni_mode_with_the_hf_baseline_only(capsys):
    assert main(["bench", "--graph", "qwen3_omni", "--url", "http://x", "--no-audio", "--baseline", "cb"]) == 2
    assert "runs in omni mode with the hf baseline" in capsys.readouterr().err
    assert main(["bench", "--graph", "qwen3_omni", "--mode", "text", "--checkpoint", "ck"]) == 2
    assert "has no mode 'text'" in capsys.readouterr().err


def test_the_runtime_package_imports_no_benchmark():
    import ast

    root = os.path.join(os.path.dirname(__file__), "..", "..", "omni_serve")
    bad = []
    for folder, _, files in os.walk(root):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                bad += [f"{path}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not bad, "\n".join(bad)
