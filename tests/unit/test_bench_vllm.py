"""``omni-serve bench --thinker-backend``: the vLLM text runner's parent side (job file, interpreter, subprocess
protocol), its request loop on a fake engine, the runner's vllm system, omni-mode labels and merged reports.
No vLLM, no Ray: the subprocess is a stand-in interpreter and the engine a fake."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from omni_serve.bench import runner as bench_runner
from benchmarks.qwen2_5_omni import systems as omni_systems
from benchmarks.qwen2_5_omni import vllm_text
from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.report import build_report, format_table, merge_reports, write_report
from omni_serve.bench.runner import BenchConfig
from benchmarks.qwen2_5_omni.vllm_text import (
    VllmTextError, VllmTextJob, drive, execute, job_command, job_env, read_job, read_result, resolve_vllm_python,
    run_vllm_text, write_job, write_result,
)
from omni_serve.cli import main

PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def _job(**kw) -> VllmTextJob:
    base = dict(checkpoint_dir="/ckpt", prompts=PROMPTS, max_new_tokens=4, min_new_tokens=4, eos_token_id=99,
                concurrency=2, label="vllm c=2", progress_every=0)
    return VllmTextJob(**{**base, **kw})


def _executable(path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# --------------------------------------------------------------------------- job file, interpreter, protocol


def test_job_round_trips_and_sizes_the_served_engine(tmp_path):
    job = _job(request_rate=2.5, arrival_seed=7, threads=2, kv_cache_gib=3.0)
    write_job(job, str(tmp_path / "job.json"))
    assert read_job(str(tmp_path / "job.json")) == job
    s = job.settings()
    assert s.max_num_seqs == 2 and s.kv_cache_gib == 3.0
    assert s.extra_engine_args == {"enable_prefix_caching": False}  # as the served thinker (its tap turns it off)
    assert s.enforce_eager and s.threads_bind == "nobind"
    assert _job(concurrency=None).settings().max_num_seqs == len(PROMPTS)
    with pytest.raises(ValidationError):
        _job(prompts=[])
    with pytest.raises(ValidationError):
        _job(surprise=1)


def test_result_round_trips(tmp_path):
    run = RunResult(label="vllm c=2", system="vllm", mode="text", concurrency=2, wall_s=1.5,
                    records=[RequestRecord(index=0, ok=True, itl_s=[0.1, 0.0], output_tokens=3)], notes=["n"])
    write_result(run, str(tmp_path / "r.json"))
    assert read_result(str(tmp_path / "r.json")) == run
    assert not (tmp_path / "r.json.tmp").exists()


def test_resolve_vllm_python_order(tmp_path, monkeypatch):
    given = _executable(tmp_path / "given", "")
    env = _executable(tmp_path / "env", "")
    monkeypatch.setenv(vllm_text.VLLM_PYTHON_ENV, env)
    assert resolve_vllm_python(given) == given
    assert resolve_vllm_python() == env
    with pytest.raises(FileNotFoundError, match="--vllm-python"):
        resolve_vllm_python(str(tmp_path / "missing"))
    monkeypatch.setenv(vllm_text.VLLM_PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="OMNI_SERVE_VLLM_PYTHON"):
        resolve_vllm_python()
    monkeypatch.delenv(vllm_text.VLLM_PYTHON_ENV)
    monkeypatch.setattr(vllm_text, "SOURCE_ROOT", str(tmp_path / "src"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="make vllm-env"):
        resolve_vllm_python()
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    venv = _executable(tmp_path / ".venv-vllm" / "bin" / "python", "")
    assert resolve_vllm_python() == venv


def test_command_and_environment(monkeypatch):
    assert job_command("/py", "j.json", "r.json") == ["/py", "-m", "benchmarks.qwen2_5_omni.vllm_text", "j.json",
                                                      "r.json"]
    env = job_env({"PYTHONPATH": "/elsewhere"})
    assert env["PYTHONPATH"].split(os.pathsep) == [vllm_text.SOURCE_ROOT, "/elsewhere"]
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert job_env({"VLLM_LOGGING_LEVEL": "DEBUG"})["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert os.path.isdir(os.path.join(vllm_text.SOURCE_ROOT, "omni_serve", "bench"))


FAKE_PYTHON = """#!{exe}
import json, sys
from benchmarks.qwen2_5_omni.vllm_text import read_job, write_result
from omni_serve.bench.records import RequestRecord, RunResult
assert sys.argv[1:3] == ["-m", "benchmarks.qwen2_5_omni.vllm_text"], sys.argv
job = read_job(sys.argv[3])
print("fake vllm: " + json.dumps({{"eos": job.eos_token_id, "threads": job.threads, "seqs": job.settings().max_num_seqs,
      "min": job.min_new_tokens, "rate": job.request_rate, "warmup": job.warmup, "python": job.python}}),
      file=sys.stderr)
if job.max_new_tokens == 13:
    print("boom: no engine", file=sys.stderr)
    sys.exit(3)
recs = [RequestRecord(index=i, ok=True, output_tokens=job.max_new_tokens, token_source="generate")
        for i in range(len(job.prompts))]
write_result(RunResult(label=job.label, system="vllm", mode="text", concurrency=job.concurrency,
                       request_rate=job.request_rate, wall_s=1.0, records=recs), sys.argv[4])
"""


def test_run_vllm_text_through_a_subprocess(tmp_path, capfd):
    fake = _executable(tmp_path / "python", FAKE_PYTHON.format(exe=sys.executable))
    run = run_vllm_text("ckpt", PROMPTS, 5, 2, eos_token_id=42, python=fake, threads=3, min_new_tokens=5,
                        warmup=False)
    assert run.label == "vllm c=2" and run.system == "vllm" and run.mode == "text" and run.concurrency == 2
    assert [r.index for r in run.records] == [0, 1, 2] and all(r.output_tokens == 5 for r in run.records)
    line = next(x for x in capfd.readouterr().err.splitlines() if x.startswith("fake vllm: "))
    sent = json.loads(line[len("fake vllm: "):])
    assert sent == {"eos": 42, "threads": 3, "seqs": 2, "min": 5, "rate": None, "warmup": False, "python": fake}
    run = run_vllm_text("ckpt", PROMPTS, 5, None, request_rate=2.0, eos_token_id=42, python=fake, label="x")
    assert run.label == "x" and run.request_rate == 2.0
    with pytest.raises(VllmTextError, match=r"status 3(.|\n)*boom: no engine"):
        run_vllm_text("ckpt", PROMPTS, 13, 1, eos_token_id=42, python=fake)
    with pytest.raises(ValueError, match="no prompts"):
        run_vllm_text("ckpt", [], 5, 1, eos_token_id=42, python=fake)


def test_run_vllm_text_reads_the_stop_token_from_the_tokenizer(tmp_path, capfd):
    fake = _executable(tmp_path / "python", FAKE_PYTHON.format(exe=sys.executable))
    tok = SimpleNamespace(convert_tokens_to_ids=lambda t: {"<|im_end|>": 77}[t])
    run_vllm_text("ckpt", PROMPTS, 5, 1, tokenizer=tok, python=fake)
    assert '"eos": 77' in capfd.readouterr().err


# --------------------------------------------------------------------------- the request loop (fake engine)


class FakeEngine:
    """Yields vLLM-shaped DELTA outputs: one token per step, the third step's two tokens in one delta."""

    def __init__(self, fail_index: int | None = None, abort_index: int | None = None):
        self.calls, self.in_flight, self.max_in_flight = [], 0, 0
        self.fail_index, self.abort_index = fail_index, abort_index
        self.started = self.cleaned = False
        self.counters = {"requests": 0, "preempted": 0}

    async def start(self):
        self.started = True

    async def cleanup(self):
        self.cleaned = True

    async def generate(self, rid, request, inputs=None):  # the Engine contract: request is a VllmRequest
        prompt, params = request.prompt, request.params
        self.calls.append((rid, list(prompt["prompt_token_ids"]), params))
        self.counters["requests"] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            n = params["max_tokens"]
            chunks = [[10], [11], [12, 13]][: max(1, n - 1)] if n > 2 else [[10]] * n
            for k, ids in enumerate(chunks):
                await asyncio.sleep(0.002)
                if rid == f"bench_{self.fail_index}" and k == 1:
                    raise RuntimeError("engine died")
                last = k == len(chunks) - 1
                reason = ("abort" if rid == f"bench_{self.abort_index}" else "length") if last else None
                yield SimpleNamespace(finished=last, outputs=[SimpleNamespace(
                    token_ids=ids, text="".join(chr(96 + t - 9) for t in ids), finish_reason=reason)])
        finally:
            self.in_flight -= 1


def _params(max_tokens, min_tokens):
    return {"max_tokens": max_tokens, "min_tokens": min_tokens}


def test_drive_times_every_token_and_keeps_every_request():
    engine = FakeEngine()
    job = _job(max_new_tokens=4, min_new_tokens=4, concurrency=2)
    records, wall = asyncio.run(drive(engine, job, _params))
    assert engine.calls[0][0] == "warmup" and engine.calls[0][2] == {"max_tokens": 2, "min_tokens": 0}
    assert sorted(c[0] for c in engine.calls[1:]) == ["bench_0", "bench_1", "bench_2"]
    assert all(c[2] == {"max_tokens": 4, "min_tokens": 4} for c in engine.calls[1:])
    assert engine.max_in_flight == 2 and wall > 0
    for i, rec in enumerate(records):
        assert rec.index == i and rec.ok and rec.error is None
        assert rec.output_tokens == 4 and rec.text_deltas == 4 and rec.token_source == "generate"
        assert len(rec.itl_s) == 3 and rec.itl_s[-1] == 0.0  # the coalesced delta's two tokens arrive together
        assert rec.ttft_s > 0 and rec.e2e_s >= rec.ttft_s + sum(rec.itl_s) - 1e-9
        assert rec.finish_reason == "length" and rec.text_chars == 4
    assert len({r.text_sha1 for r in records}) == 1
    assert records[2].start_s > 0  # it waited for a slot (closed loop at 2)


def test_drive_records_failures_and_aborts():
    engine = FakeEngine(fail_index=0, abort_index=1)
    records, _ = asyncio.run(drive(engine, _job(warmup=False, concurrency=None), _params))
    assert [c[0] for c in engine.calls if c[0] == "warmup"] == []
    assert not records[0].ok and "engine died" in records[0].error and records[0].output_tokens == 1
    assert not records[1].ok and "abort" in records[1].error
    assert records[2].ok and engine.max_in_flight == 3


def test_drive_open_loop_follows_the_arrivals():
    from omni_serve.bench.client import poisson_arrivals

    job = _job(concurrency=None, request_rate=20.0, arrival_seed=3, warmup=False)
    records, _ = asyncio.run(drive(FakeEngine(), job, _params))
    for rec, at in zip(records, poisson_arrivals(3, 20.0, 3)):
        assert rec.start_s >= at - 1e-3


def test_execute_starts_and_cleans_up_the_engine():
    engine = FakeEngine()
    run = execute_sync(engine, _job(python="/venv/bin/python"))
    assert engine.started and engine.cleaned
    assert run.system == "vllm" and run.label == "vllm c=2" and run.num_errors == 0
    assert "prefix caching off" in run.notes[0] and "/venv/bin/python" in run.notes[0]
    assert "max_num_seqs=2" in run.notes[0] and run.notes[1] == "engine counters: requests 4, preempted 0"


def execute_sync(engine, job):
    return asyncio.run(execute(job, make_engine=lambda j: engine, params=_params))


# --------------------------------------------------------------------------- CLI and config


def _capture_run_bench(monkeypatch):
    seen = {}

    def fake(cfg, systems=None):
        seen["cfg"] = cfg
        return SimpleNamespace(table="T", json_path="j", png_path="p",
                               runs=[RunResult(label="x", system="vllm", records=[RequestRecord(index=0, ok=True)])])
    monkeypatch.setattr(bench_runner, "run_bench", fake)
    return seen


def test_cli_parses_thinker_backends_and_vllm_python(monkeypatch, tmp_path, capsys):
    seen = _capture_run_bench(monkeypatch)
    py = _executable(tmp_path / "python", "")
    assert main(["bench", "--mode", "text", "--checkpoint", "ck", "--thinker-backend", "native,vllm",
                 "--vllm-python", py]) == 0
    assert seen["cfg"].thinker_backends == ["native", "vllm"] and seen["cfg"].vllm_python == py
    monkeypatch.setenv(vllm_text.VLLM_PYTHON_ENV, py)
    assert main(["bench", "--mode", "text", "--checkpoint", "ck", "--thinker-backend", "vllm"]) == 0
    assert seen["cfg"].vllm_python == py  # resolved from the environment and recorded
    assert main(["bench", "--mode", "text", "--checkpoint", "ck"]) == 0
    assert seen["cfg"].thinker_backends == ["native"] and seen["cfg"].vllm_python is None
    assert main(["bench", "--url", "http://x", "--thinker-backend", "vllm", "--baseline", "none"]) == 0
    assert seen["cfg"].thinker_backends == ["vllm"] and seen["cfg"].engine_system() == "engine_vllm"


def test_cli_rejects_bad_backends_and_a_missing_interpreter(monkeypatch, tmp_path, capsys):
    _capture_run_bench(monkeypatch)
    with pytest.raises(SystemExit):
        main(["bench", "--mode", "text", "--checkpoint", "ck", "--thinker-backend", "native,tgi"])
    assert main(["bench", "--mode", "text", "--checkpoint", "ck", "--thinker-backend", "vllm",
                 "--vllm-python", str(tmp_path / "nope")]) == 2
    assert "make vllm-env" in capsys.readouterr().err
    assert main(["bench", "--url", "http://x", "--thinker-backend", "native,vllm", "--baseline", "none"]) == 2
    assert "one thinker backend" in capsys.readouterr().err
    with pytest.raises(ValidationError, match="without repeats"):
        BenchConfig(mode="text", checkpoint="ck", thinker_backends=["vllm", "vllm"])


def test_help_lists_the_backend_options(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = capsys.readouterr().out
    assert "--thinker-backend" in text and "--vllm-python" in text


# --------------------------------------------------------------------------- runner


def _fake_run(label, system, c, tokens=4, sha="a"):
    recs = [RequestRecord(index=i, ok=True, e2e_s=1.0, ttft_s=0.1, itl_s=[0.3] * (tokens - 1), output_tokens=tokens,
                          token_source="generate", text_sha1=sha) for i in range(3)]
    return RunResult(label=label, system=system, mode="text", concurrency=c, wall_s=1.0 if system == "vllm" else 2.0,
                     records=recs)


@pytest.fixture
def torch_threads():
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # the text runner sets the process' threads from --threads


def test_text_runner_runs_each_backend_then_the_baseline(monkeypatch, tmp_path, omni_tiny_dir, torch_threads):
    from benchmarks.qwen2_5_omni import cb_baseline, engine_text

    calls = []
    monkeypatch.setattr(cb_baseline, "text_prompts", lambda ck, reqs, sp=None: [[1, 2]] * len(reqs))
    monkeypatch.setattr(engine_text, "run_engine_text", lambda ck, p, m, c, **kw: (
        calls.append(("native", c, kw)), _fake_run(f"engine_text c={c}", "engine_text", c))[1])

    def fake_vllm(ck, p, m, c, **kw):
        calls.append(("vllm", c, kw))
        if c == 3:
            raise VllmTextError("the vLLM text run exited with status 1\nTraceback ...")
        return _fake_run(kw["label"], "vllm", c)
    monkeypatch.setattr(vllm_text, "run_vllm_text", fake_vllm)
    monkeypatch.setattr(omni_systems, "_cb_runs", lambda cfg, prompts: [
        _fake_run(f"cb c={p.concurrency}", "cb", p.concurrency, sha="b") for p in cfg.points()])
    py = _executable(tmp_path / "python", "")
    cfg = BenchConfig(mode="text", checkpoint=omni_tiny_dir, num_requests=3, concurrency=[1, 2, 3], max_tokens=4,
                      min_tokens=4, thinker_backends=["native", "vllm"], vllm_python=py, threads=1,
                      vllm_kv_cache_gib=2.0, progress_every=0, out=str(tmp_path / "out"))
    outcome = bench_runner.run_bench(cfg, omni_systems.OmniSystems())
    assert [r.label for r in outcome.runs] == ["engine_text c=1", "engine_text c=2", "engine_text c=3", "vllm c=1",
                                               "vllm c=2", "vllm c=3", "cb c=1", "cb c=2", "cb c=3"]
    assert [(b, c) for b, c, _ in calls] == [("native", 1), ("native", 2), ("native", 3), ("vllm", 1), ("vllm", 2),
                                             ("vllm", 3)]
    vkw = calls[3][2]
    assert vkw["python"] == py and vkw["threads"] == 1 and vkw["kv_cache_gib"] == 2.0
    assert vkw["min_new_tokens"] == 4 and vkw["warmup"] is True and vkw["label"] == "vllm c=1"
    failed = outcome.runs[5]
    assert failed.system == "vllm" and failed.num_errors == 3 and "status 1" in failed.records[0].error
    rep = outcome.report
    assert rep["config"]["thinker_backends"] == ["native", "vllm"] and rep["config"]["threads_used"] == 1
    pairs = {(c["engine"], c["baseline"]) for c in rep["comparisons"]}
    assert {("vllm c=1", "engine_text c=1"), ("vllm c=1", "cb c=1"), ("engine_text c=2", "cb c=2")} <= pairs
    vs_native = next(c for c in rep["comparisons"] if c["engine"] == "vllm c=2" and c["baseline"] == "engine_text c=2")
    assert vs_native["throughput_ratio"]["output_tokens_per_s"] == pytest.approx(2.0)
    assert vs_native["identical_text"] == {"compared": 3, "identical": 3}
    assert any("thinker backends" in n for n in rep["notes"])
    assert "vllm c=2" in outcome.table and os.path.getsize(outcome.png_path) > 0


def test_omni_runner_labels_the_engine_runs_by_thinker_backend(monkeypatch, tmp_path):
    from tests.unit.bench_fakes import patch_engine_client

    patch_engine_client(monkeypatch)
    for backend, system in (("vllm", "engine_vllm"), ("native", "engine")):
        cfg = BenchConfig(url="http://x", model="m", num_requests=2, concurrency=[1, 4], thinker_backends=[backend],
                          progress_every=0, out=str(tmp_path / backend))
        outcome = bench_runner.run_bench(cfg)
        assert [(r.label, r.system) for r in outcome.runs] == [(f"{system} c=1", system), (f"{system} c=4", system)]
        assert outcome.report["config"]["thinker_backends"] == [backend]
        assert any(f"thinker backend {backend}" in n for n in outcome.report["notes"])


# --------------------------------------------------------------------------- merged reports


def _omni_run(label, system, c, wall, streaming=True):
    recs = [RequestRecord(index=i, ok=True, e2e_s=wall, ttft_s=0.1, output_tokens=8, token_source="usage",
                          audio_seconds=2.0, text_sha1="s") for i in range(2)]
    return RunResult(label=label, system=system, concurrency=c, wall_s=wall, streaming=streaming, records=recs)


def test_merge_reports_compares_both_backends_with_one_baseline(tmp_path):
    cfg = {"mode": "omni", "num_requests": 2, "seed": 0, "max_tokens": 8, "min_tokens": 8, "audio": True}
    native = build_report([_omni_run("engine c=1", "engine", 1, 4.0)], config={**cfg, "thinker_backends": ["native"]})
    vllm = build_report([_omni_run("engine_vllm c=1", "engine_vllm", 1, 2.0), _omni_run("hf", "hf", 1, 8.0, False)],
                        config={**cfg, "thinker_backends": ["vllm"]})
    native, vllm = json.loads(json.dumps(native)), json.loads(json.dumps(vllm))  # as read back from the files
    report, runs = merge_reports([native, vllm])
    assert [r.label for r in runs] == ["engine c=1", "engine_vllm c=1", "hf"]
    pairs = {(c["engine"], c["baseline"]): c for c in report["comparisons"]}
    assert set(pairs) == {("engine c=1", "hf"), ("engine_vllm c=1", "hf"), ("engine_vllm c=1", "engine c=1")}
    assert pairs[("engine_vllm c=1", "engine c=1")]["throughput_ratio"]["requests_per_s"] == pytest.approx(2.0)
    assert [c["thinker_backends"] for c in report["config"]["merged"]] == [["native"], ["vllm"]]
    assert sum(n.startswith("ratios are engine") for n in report["notes"]) == 1
    json_path, png_path = write_report(report, runs, str(tmp_path / "merged"))
    assert "engine_vllm c=1" in format_table(report) and os.path.getsize(png_path) > 0
    from omni_serve.bench.report import main as report_main

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bench_report.json").write_text(json.dumps(native))
    (tmp_path / "b.json").write_text(json.dumps(vllm))
    assert report_main(["merge", str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b.json")]) == 0
    assert json.loads((tmp_path / "m" / "bench_report.json").read_text())["comparisons"]
    assert report_main(["merge", str(tmp_path / "m")]) == 2


def test_merge_reports_refuses_other_workloads_and_repeated_labels():
    run = _omni_run("engine c=1", "engine", 1, 4.0)
    a = build_report([run], config={"num_requests": 2, "seed": 0})
    with pytest.raises(ValueError, match="seed"):
        merge_reports([a, build_report([_omni_run("hf", "hf", 1, 8.0)], config={"num_requests": 2, "seed": 1})])
    with pytest.raises(ValueError, match="engine c=1"):
        merge_reports([a, a])
    with pytest.raises(ValueError, match="no reports"):
        merge_reports([])
