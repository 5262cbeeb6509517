"""``omni-serve bench --mode video`` (the wan bench) without Ray or a server: the plug-in's wiring and flags, the
workload, the job client against a fake Videos API (httpx.MockTransport), the report maths, the diffusers baseline
on the tiny checkpoint, and the ceiling script's reading of the serve config."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from omni_serve.api.video_out import encode_mp4
from omni_serve.bench.video import (
    VideoBenchConfig, VideoRecord, VideoRunResult, build_video_report, build_video_workload, format_video_table,
    run_video_load, videos_url, write_video_report,
)
from omni_serve.cli import main


def _frames(seed: int, frames: int = 5, size: int = 16) -> np.ndarray:
    blocks = np.random.default_rng(seed).integers(0, 256, (frames, size // 8, size // 8, 3), dtype=np.uint8)
    return blocks.repeat(8, axis=1).repeat(8, axis=2)  # flat 8x8 blocks: H.264 keeps them nearly exact


def test_the_wan_bench_is_registered_with_its_video_mode(capsys):
    from omni_serve.bench.plugins import benches, resolve

    assert list(benches()["wan"].modes) == ["video"]
    assert resolve(None, "video").family == "wan" and resolve("wan", None).family == "wan"
    with pytest.raises(SystemExit):
        main(["bench", "--graph", "wan", "--help"])
    text = capsys.readouterr().out
    for flag in ("--num-frames", "--fps", "--guidance-scale", "--poll-interval", "--baseline-dtype"):
        assert flag in text
    assert "--true-cfg-scale" not in text  # the image mode's flags are not the video mode's


def test_cli_video_arguments(capsys, monkeypatch):
    captured = {}
    monkeypatch.setattr("omni_serve.bench.video.run_video_bench",
                        lambda cfg, baseline: captured.update(cfg=cfg, baseline=baseline))
    monkeypatch.setattr("omni_serve.bench.cli.finish", lambda outcome: 0)
    assert main(["bench", "--mode", "video", "--url", "http://h:1", "--checkpoint", "/ckpt", "--size", "64x32",
                 "--num-frames", "9", "--fps", "8", "--steps", "4", "--guidance-scale", "3", "--negative-prompt",
                 "blurry", "--poll-interval", "0.1", "--concurrency", "1,4", "--num-requests", "6", "--threads", "2",
                 "--stop-server-pid", "123", "--no-calibration"]) == 0
    cfg = captured["cfg"]
    assert (cfg.baseline, cfg.size, cfg.num_frames, cfg.fps, cfg.steps, cfg.guidance_scale, cfg.negative_prompt) == (
        "diffusers", "64x32", 9, 8, 4, 3.0, "blurry")
    assert (cfg.poll_s, cfg.concurrency, cfg.num_requests, cfg.threads, cfg.stop_server_pid, cfg.calibrate) == (
        0.1, [1, 4], 6, 2, 123, False)
    assert callable(captured["baseline"])
    captured.clear()
    assert main(["bench", "--graph", "wan", "--url", "http://h:1"]) == 0  # the family's first mode, its defaults
    cfg = captured["cfg"]
    assert (cfg.baseline, cfg.concurrency, cfg.size, cfg.num_frames, cfg.steps, cfg.guidance_scale) == (
        "none", [1, 4], "128x128", 17, 20, 5.0)
    for argv, message in [([], "needs --url"), (["--num-frames", "16"], "4k + 1"),
                          (["--baseline", "hf"], "diffusers or none"), (["--baseline", "diffusers"], "--checkpoint"),
                          (["--request-rate", "1"], "closed loops only"), (["--size", "64"], "WIDTHxHEIGHT")]:
        url = [] if message == "needs --url" else ["--url", "http://h:1"]
        assert main(["bench", "--mode", "video", *url, *argv]) == 2, argv
        assert message in capsys.readouterr().err


def test_workload_bodies_and_pipeline_arguments():
    cfg = VideoBenchConfig(url="http://x", baseline="none", num_requests=4, seed=3, size="64x32", num_frames=9,
                           fps=8, steps=5, guidance_scale=4.0)
    a = build_video_workload(cfg)
    assert a == build_video_workload(cfg) and [r.seed for r in a] == [3, 4, 5, 6] and len({r.prompt for r in a}) == 4
    assert a[0].video_seconds == 9 / 8
    assert a[0].body("wan2.1-t2v") == {
        "prompt": a[0].prompt, "size": "64x32", "num_frames": 9, "fps": 8, "num_inference_steps": 5,
        "guidance_scale": 4.0, "seed": 3, "output_format": "mp4", "model": "wan2.1-t2v"}
    assert a[0].pipeline_kwargs() == {"prompt": a[0].prompt, "width": 64, "height": 32, "num_frames": 9,
                                      "num_inference_steps": 5, "guidance_scale": 4.0, "output_type": "np"}
    neg = build_video_workload(cfg.model_copy(update={"negative_prompt": "blurry"}))[0]
    assert neg.body(None)["negative_prompt"] == "blurry" == neg.pipeline_kwargs()["negative_prompt"]
    assert "model" not in neg.body(None)
    assert videos_url("http://h:1") == videos_url("http://h:1/v1/") == "http://h:1/v1/videos"
    with pytest.raises(ValidationError, match="needs --checkpoint"):
        VideoBenchConfig(url="http://x")


def _fake_videos_api(seen: dict):
    """Seed 1: the job fails; seed 2: a 429; seed 3: an MP4 of the wrong frame count; others complete after two
    polls with an MP4 of the seed's frames."""
    jobs: dict[str, dict] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "POST":
            assert path == "/v1/videos"
            body = json.loads(request.content)
            seen.setdefault("bodies", []).append(body)
            if body["seed"] == 2:
                return httpx.Response(429, json={"error": {"message": "too many jobs", "type": "rate_limit"}})
            job_id = f"video_{len(jobs):x}"
            jobs[job_id] = {"body": body, "polls": 0}
            return httpx.Response(200, json={"id": job_id, "status": "queued", "progress": 0})
        job_id = path.split("/")[3]
        job = jobs[job_id]
        if path.endswith("/content"):
            frames = job["body"]["num_frames"] - (4 if job["body"]["seed"] == 3 else 0)
            return httpx.Response(200, content=encode_mp4(_frames(job["body"]["seed"], frames), job["body"]["fps"]))
        job["polls"] += 1
        if job["body"]["seed"] == 1:
            return httpx.Response(200, json={"id": job_id, "status": "failed", "progress": 40,
                                             "error": {"code": "generation_failed", "message": "stage died"}})
        done = job["polls"] >= 2
        return httpx.Response(200, json={"id": job_id, "status": "completed" if done else "in_progress",
                                         "progress": 100 if done else 50})
    return handler


def test_the_job_client_creates_polls_downloads_and_counts_failures():
    cfg = VideoBenchConfig(url="http://fake:8000", baseline="none", num_requests=5, size="16x16", num_frames=5,
                           fps=8)
    seen: dict = {}
    run = asyncio.run(run_video_load(cfg.url, build_video_workload(cfg), "wan2.1-t2v", 2, poll_s=0.01,
                                     transport=httpx.MockTransport(_fake_videos_api(seen)), progress_every=0))
    assert run.label == "engine c=2" and run.mode == "video" and len(run.records) == 5
    ok, failed, rejected, short, good = run.records
    assert [r.ok for r in run.records] == [True, False, False, False, True]
    assert run.num_errors == 2 and run.num_rejected == 1
    assert failed.error == "job failed: generation_failed: stage died"
    assert rejected.status == 429 and rejected.rejected and rejected.error == "HTTP 429: too many jobs"
    assert short.error == "expected 5 frames of 16x16, got 1 of 16x16"
    for rec in (ok, good):
        assert rec.polls == 2 and rec.num_frames == 5 and rec.video_seconds == 5 / 8 and rec.bytes > 0
        assert rec.frames.shape == (5, 16, 16, 3) and 0 < rec.create_s <= rec.e2e_s and rec.download_s > 0
    error = lambda seed: np.abs(good.frames.astype(int) - _frames(seed)).mean()  # noqa: E731
    assert error(4) < 10 and error(0) > 5 * error(4)  # the MP4 decoded back: the frames sent (H.264, tv range: lossy)
    assert {b["model"] for b in seen["bodies"]} == {"wan2.1-t2v"}
    assert "frames" not in good.to_dict() and json.dumps(run.to_dict())


def _rec(i, e2e=1.0, frames=None, ok=True, compute=None):
    if not ok:
        return VideoRecord(index=i, e2e_s=e2e, error="job failed: x: y")
    return VideoRecord(index=i, ok=True, e2e_s=e2e, video_seconds=2.0, num_frames=17, frames=frames, create_s=0.01,
                       download_s=0.02, polls=3, bytes=1000, compute_s=compute)


def _run(label, system, concurrency, wall, records):
    return VideoRunResult(label=label, system=system, mode="video", concurrency=concurrency, wall_s=wall,
                          streaming=False, records=records)


def test_report_rates_ratios_and_agreement(tmp_path):
    px = [_frames(i) for i in range(4)]
    c1 = _run("engine c=1", "engine", 1, 8.0, [_rec(i, 2.0, px[i]) for i in range(4)])
    c4 = _run("engine c=4", "engine", 4, 2.0, [_rec(i, 1.5, px[i]) for i in range(3)] + [_rec(3, ok=False)])
    off = [p.copy() for p in px]
    off[1][0, 0, 0, 0] ^= 1  # one pixel differs by one level
    base = _run("diffusers", "diffusers", 1, 16.0, [_rec(i, 4.0, off[i], compute=3.5) for i in range(4)])
    report = build_video_report([c1, c4, base], config={"x": 1}, notes=["n"])
    runs = {s["label"]: s for s in report["runs"]}
    assert runs["engine c=1"]["throughput"] == {"videos_per_hour": 1800.0, "video_s_per_s": 1.0}
    assert runs["engine c=4"]["num_errors"] == 1 and runs["engine c=4"]["throughput"]["videos_per_hour"] == 5400.0
    assert runs["diffusers"]["latency_s"]["compute"]["p50"] == 3.5 and runs["diffusers"]["latency_s"]["e2e"]["p95"] == 4
    ratios = {c["engine"]: c for c in report["comparisons"]}
    assert ratios["engine c=1"]["throughput_ratio"]["videos_per_hour"] == pytest.approx(2.0)
    assert ratios["engine c=4"]["throughput_ratio"]["video_s_per_s"] == pytest.approx(6.0)
    assert ratios["engine c=4"]["e2e_ratio"]["p50"] == pytest.approx(1.5 / 4)
    agree = report["agreement"]
    assert (agree["engine"], agree["compared"], agree["identical"], agree["max_abs_diff"]) == ("engine c=1", 4, 3, 1)
    assert agree["psnr_db_min"] > 60
    table = format_video_table(report)
    assert "engine c=4" in table and "5400.0" in table and "1 x job failed: x: y" in table and "3 identical" in table
    json_path, png_path = write_video_report(report, [c1, c4, base], str(tmp_path))
    data = json.loads(Path(json_path).read_text())  # strict JSON: the identical videos' PSNR is null
    assert data["agreement"]["per_request_psnr_db"]["0"] is None and data["runs"][0]["label"] == "engine c=1"
    assert Path(png_path).read_bytes()[:4] == b"\x89PNG"


def test_diffusers_baseline_on_the_tiny_checkpoint(wan_tiny_dir):
    from benchmarks.wan.baseline import from_config

    cfg = VideoBenchConfig(url="http://x", checkpoint=wan_tiny_dir, num_requests=2, size="32x16", num_frames=5,
                           steps=2, threads=1)
    requests = build_video_workload(cfg)
    run = from_config(cfg).run(requests, warmup=0, progress_every=0)
    assert run.system == "diffusers" and run.mode == "video" and run.num_errors == 0, run.records[0].error
    for rec in run.records:
        assert rec.frames.shape == (5, 16, 32, 3) and rec.video_seconds == 5 / 16 and 0 < rec.compute_s < rec.e2e_s
    assert any("WanPipeline" in n for n in run.notes) and any("MP4" in n for n in run.notes)


def test_the_ceiling_reads_each_stages_threads_from_the_serve_config(tmp_path):
    from benchmarks.wan.ceiling import batches, stage_threads

    assert batches(4) == [1, 2, 4] and batches(6) == [1, 2, 4, 6] and batches(1) == [1]
    config = tmp_path / "c.yaml"
    config.write_text("stages:\n  vae:\n    engine: {torch_threads: 2}\n")
    assert stage_threads(str(config)) == {"text_encoder": 1, "dit": 2, "vae": 2}  # the dit's default: 2
    shipped = Path(__file__).parents[2] / "benchmarks" / "wan" / "small.yaml"
    assert set(stage_threads(str(shipped))) == {"text_encoder", "dit", "vae"}
