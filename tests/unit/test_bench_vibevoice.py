"""``omni-serve bench --graph vibevoice --mode speech`` without Ray or a server: the plug-in's registration and flags,
the speech bench config it builds, the stutter verdict, the benchmark's serve config (small.yaml) as run.sh and
ceiling.py read it, and the transformers baseline on the tiny checkpoint (the ingress' prompt, the served bound)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from omni_serve.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_the_vibevoice_bench_is_registered_with_its_speech_mode(capsys, tmp_path):
    from omni_serve.bench.plugins import benches, resolve

    assert list(benches()["vibevoice"].modes) == ["speech"]
    assert resolve("vibevoice", None).family == "vibevoice"
    assert resolve(None, "speech").family == "qwen2_5_omni"  # still the default speech bench
    (tmp_path / "omni_serve_checkpoint.json").write_text(json.dumps({"family": "vibevoice"}))
    assert resolve(None, "speech", str(tmp_path)).family == "vibevoice"  # a vibevoice checkpoint picks it
    with pytest.raises(SystemExit):
        main(["bench", "--graph", "vibevoice", "--help"])
    text = capsys.readouterr().out
    for flag in ("--voice", "--max-speech-seconds", "--min-words", "--max-words", "--baseline-requests",
                 "--no-retry"):
        assert flag in text
    assert "--max-codec-tokens" not in text  # the Omni benches' flags are not this one's


def test_cli_speech_arguments(capsys, monkeypatch):
    captured = {}

    def fake_bench(cfg, baseline):
        captured.update(cfg=cfg, baseline=baseline)
        return {"points": [{"system": "engine", "concurrency": 8, "failed": 0,
                            "playback": {"chunk_gap_s": {"p95": 0.05}}}]}
    monkeypatch.setattr("omni_serve.bench.speech.run_speech_bench", fake_bench)
    monkeypatch.setattr("omni_serve.bench.speech.format_report", lambda report: "table")
    assert main(["bench", "--graph", "vibevoice", "--url", "http://h:1", "--checkpoint", "/ckpt",
                 "--max-speech-seconds", "10", "--concurrency", "1,8", "--num-requests", "6", "--threads", "2",
                 "--stop-server-pid", "123", "--no-calibration", "--seed", "3", "--min-words", "5",
                 "--max-words", "9", "--baseline-requests", "4"]) == 0
    cfg = captured["cfg"]
    assert (cfg.graph, cfg.baseline, cfg.voice, cfg.default_voice(), cfg.max_speech_seconds, cfg.checkpoint) == (
        "vibevoice", "hf", "alice", "alice", 10.0, "/ckpt")
    assert (cfg.concurrency, cfg.num_requests, cfg.threads, cfg.stop_server_pid, cfg.calibrate, cfg.seed) == (
        [1, 8], 6, 2, 123, False, 3)
    assert (cfg.min_words, cfg.max_words, cfg.baseline_requests, cfg.retry_rejected) == (5, 9, 4, True)
    assert callable(captured["baseline"])
    out = capsys.readouterr().out
    assert "engine c=8: chunk gap p95 50 ms, below a chunk's 133 ms of audio" in out
    captured.clear()
    assert main(["bench", "--graph", "vibevoice", "--url", "http://h:1", "--voice", "bob", "--no-retry"]) == 0
    cfg = captured["cfg"]  # the family's first mode, its defaults; no checkpoint: no baseline
    assert (cfg.baseline, cfg.concurrency, cfg.voice, cfg.max_speech_seconds, cfg.retry_rejected) == (
        "none", [1, 8], "bob", 120.0, False)
    for argv, message in [([], "needs --url"), (["--baseline", "cb"], "hf (transformers' generate) or none"),
                          (["--baseline", "hf"], "--checkpoint"),
                          (["--max-speech-seconds", "0"], "greater than 0")]:
        url = [] if message == "needs --url" else ["--url", "http://h:1"]
        assert main(["bench", "--graph", "vibevoice", *url, *argv]) == 2, argv
        assert message in capsys.readouterr().err


def test_the_stutter_verdict_and_the_speech_summary():
    from benchmarks.vibevoice import CHUNK_S, stutter_lines

    from omni_serve.bench.speech import SpeechBenchConfig, SpeechPoint, SpeechRecord

    assert abs(CHUNK_S - 3200 / 24000) < 1e-12
    report = {"points": [{"system": "engine", "concurrency": 1, "playback": {"chunk_gap_s": {"p95": 0.2}}},
                         {"system": "engine", "concurrency": 8, "playback": None},
                         {"system": "hf", "concurrency": 1, "playback": {"chunk_gap_s": {"p95": 9.0}}}]}
    assert stutter_lines(report) == ["engine c=1: chunk gap p95 200 ms, NOT below a chunk's 133 ms of audio"]
    records = [SpeechRecord(ok=True, ttfp_s=0.1, e2e_s=e, audio_s=2.0) for e in (1.0, 2.0, 4.0)]
    assert SpeechPoint("engine", 1, 7.0, records).summary()["rtf_p50"] == 1.0
    assert SpeechBenchConfig(url="http://x", graph="vibevoice").default_voice() == "alice"
    assert SpeechBenchConfig(url="http://x").default_voice() == "Chelsie"


def test_the_serve_config_bounds_speech_for_run_sh_and_the_ceiling():
    from benchmarks.vibevoice.baseline import max_new_tokens
    from benchmarks.vibevoice.ceiling import load_spec, served_tokens

    config = ROOT / "benchmarks" / "vibevoice" / "small.yaml"
    spec = load_spec(str(config), "checkpoints/vibevoice-small")
    run_sh = (ROOT / "benchmarks" / "vibevoice" / "run.sh").read_text()
    assert "--max-speech-seconds" in run_sh and "--stop-server-pid" in run_sh
    # run.sh's sed reads the same bound the spec holds: the baseline's max_new_tokens is the server's
    sed = re.search(r"^max_speech_seconds: *([0-9.]+)", config.read_text(), re.M)
    assert float(sed.group(1)) == spec.max_speech_seconds == 10
    assert served_tokens(spec) == max_new_tokens(spec.max_speech_seconds) == 75
    assert max_new_tokens(None) == math.ceil(120 * 7.5)
    lm = spec.stage_spec("lm")  # a replica of one thread per core, each batching its share of concurrency 8
    assert (lm.num_replicas, lm.engine.torch_threads) == (2, 1) and lm.engine.ar.max_num_seqs >= 8
    assert spec.ingress.num_cpus + lm.num_replicas * lm.num_cpus <= 2  # fits the 2-core box's logical CPUs


def test_the_baseline_speaks_the_ingress_prompt_to_the_served_bound(vibevoice_tiny_dir):
    from transformers import AutoProcessor

    from benchmarks.vibevoice.baseline import inputs, preset_clip, run_baseline
    from omni_serve.bench.speech import SpeechBenchConfig
    from omni_serve.models.vibevoice_prompt import parse_script, prompt_ids, voice_frames

    processor = AutoProcessor.from_pretrained(vibevoice_tiny_dir)
    clip = preset_clip(vibevoice_tiny_dir, "ALICE")  # matched case-insensitively, as the ingress does
    with pytest.raises(ValueError, match="presets: alice, bob"):
        preset_clip(vibevoice_tiny_dir, "carol")
    cfg = SpeechBenchConfig(url="http://x", graph="vibevoice", checkpoint=vibevoice_tiny_dir, num_requests=2,
                            max_speech_seconds=4 / 7.5, threads=1, calibrate=False)
    for text in cfg.texts():
        ids = prompt_ids(processor, parse_script(text), {"0": voice_frames(clip.size, 3200)})
        assert inputs(processor, text, clip)["input_ids"][0].tolist() == ids
    point = run_baseline(cfg, cfg.texts())
    assert point.system == "hf" and point.concurrency == 1 and len(point.records) == 2
    assert all(r.ok and r.audio_s == 4 * 3200 / 24000 and r.ttfp_s == r.e2e_s for r in point.records)
