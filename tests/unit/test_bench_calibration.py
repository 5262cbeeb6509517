"""The bench's calibration: a fixed CPU workload timed before the engine runs and before the baselines, so machine
drift between the two phases shows in the report instead of silently skewing the ratios."""

from __future__ import annotations

import pytest
import torch

from omni_serve.bench import calibration
from omni_serve.bench import runner as bench_runner
from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.runner import BenchConfig
from tests.unit.bench_fakes import patch_engine_client


def test_calibrate_times_the_workload_and_restores_torch_threads():
    before = torch.get_num_threads()
    seconds = calibration.calibrate(threads=1, reps=3)
    assert 0 < seconds < 10
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("engine,baseline,expect", [
    (0.100, 0.109, None), (0.100, 0.091, None),  # within 10%: no note
    (0.100, 0.120, "20% slower"), (0.100, 0.080, "20% faster")])
def test_drift_note_flags_only_drift_above_ten_percent(engine, baseline, expect):
    note = calibration.drift_note(engine, baseline)
    if expect is None:
        assert note is None
    else:
        assert expect in note and "skewed" in note


def _omni_fakes(monkeypatch, timings):
    patch_engine_client(monkeypatch)
    phases = []
    times = iter(timings)
    monkeypatch.setattr(calibration, "calibrate", lambda: (phases.append("calibrate"), next(times))[1])
    return phases, FakeSystems(phases)


class FakeSystems:
    """The family's in-process systems: an hf baseline that records when it ran."""

    def __init__(self, phases):
        self.phases = phases

    def baseline_runs(self, system, cfg, requests, prompts=None):
        self.phases.append(system)
        return [RunResult(label=system, system=system, concurrency=1, wall_s=2.0,
                          records=[RequestRecord(index=r.index, ok=True, e2e_s=2.0) for r in requests])]


def test_omni_bench_calibrates_before_the_engine_and_before_the_baseline(monkeypatch, tmp_path, omni_tiny_dir):
    phases, systems = _omni_fakes(monkeypatch, [0.10, 0.13])
    cfg = BenchConfig(url="http://x", model="m", checkpoint=omni_tiny_dir, num_requests=2, concurrency=[1],
                      baselines=["hf"], progress_every=0, out=str(tmp_path))
    outcome = bench_runner.run_bench(cfg, systems)
    assert phases == ["calibrate", "calibrate", "hf"]
    assert outcome.report["config"]["calibration_s"] == {"engine": 0.10, "baseline": 0.13}
    assert any("drifted" in n and "30% slower" in n for n in outcome.report["notes"])


def test_omni_bench_without_drift_or_without_baseline_adds_no_note(monkeypatch, tmp_path, omni_tiny_dir):
    phases, systems = _omni_fakes(monkeypatch, [0.10, 0.108])
    cfg = BenchConfig(url="http://x", model="m", checkpoint=omni_tiny_dir, num_requests=2, concurrency=[1],
                      baselines=["hf"], progress_every=0, out=str(tmp_path / "a"))
    outcome = bench_runner.run_bench(cfg, systems)
    assert not any("drifted" in n for n in outcome.report["notes"])
    phases.clear()
    for kw in (dict(baselines=[]), dict(baselines=["hf"], calibrate=False)):
        cfg = BenchConfig(url="http://x", model="m", checkpoint=omni_tiny_dir, num_requests=2, concurrency=[1],
                          progress_every=0, out=str(tmp_path / "b"), **kw)
        outcome = bench_runner.run_bench(cfg, systems)
        assert "calibration_s" not in outcome.report["config"]
    assert "calibrate" not in phases


def test_speech_bench_calibrates_around_its_baseline_and_reports_drift(monkeypatch, tmp_path, omni_tiny_dir):
    from omni_serve.bench import speech

    def point(system, wall):
        return speech.SpeechPoint(system, 1, wall, [speech.SpeechRecord(ok=True, audio_s=1.0, e2e_s=wall, ttfp_s=0.1)])
    monkeypatch.setattr(speech, "run_engine", lambda cfg, texts: [point("engine", 1.0)])
    times = iter([0.10, 0.08])
    monkeypatch.setattr(calibration, "calibrate", lambda: next(times))
    cfg = speech.SpeechBenchConfig(url="http://x", checkpoint=omni_tiny_dir, num_requests=1, concurrency=[1],
                                   out=str(tmp_path))
    report = speech.run_speech_bench(cfg, lambda cfg, texts: point("hf", 2.0))
    assert report["calibration_s"] == {"engine": 0.10, "baseline": 0.08}
    assert report["ratios"] == {"engine_c1_over_hf_audio_s_per_s": 2.0}
    assert any("20% faster" in n for n in report["notes"]) and "20% faster" in speech.format_report(report)
