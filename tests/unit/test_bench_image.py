"""``omni-serve bench --mode image`` without Ray or a server: workload determinism, the HTTP client against a fake
image server (httpx.MockTransport), the report maths (ratios, parity, PSNR), the diffusers baseline on the tiny
checkpoint and the CLI arguments."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
from pydantic import ValidationError

from benchmarks.diffusers_image import DiffusersImageBaseline
from benchmarks.qwen_image.baseline import load_pipeline as load_qwen_image
from benchmarks.qwen_image_edit.baseline import load_pipeline as load_qwen_image_edit
from omni_serve.bench.image import (
    ImageBenchConfig, ImageRecord, ImageRunResult, build_image_workload, images_url,
    run_image_load,
)
from omni_serve.bench.image_report import (
    build_image_report, format_image_table, max_abs_diff, psnr, write_image_report,
)
from omni_serve.cli import main



def _png(pixels: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _pixels(seed: int, size: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


def test_workload_is_deterministic_and_seeds_follow_the_index():
    cfg = ImageBenchConfig(url="http://x", baseline="none", num_requests=5, seed=7, size="64x32", steps=3)
    a, b = build_image_workload(cfg), build_image_workload(cfg)
    assert a == b
    assert [r.seed for r in a] == [7, 8, 9, 10, 11]
    assert len({r.prompt for r in a}) == 5
    assert a != build_image_workload(cfg.model_copy(update={"seed": 8}))
    body = a[0].body("qwen-image", {"mode": "off"})
    assert body == {"prompt": a[0].prompt, "n": 1, "size": "64x32", "response_format": "b64_json", "seed": 7,
                    "num_inference_steps": 3, "model": "qwen-image", "cache": {"mode": "off"}}
    kw = a[0].pipeline_kwargs()
    assert (kw["width"], kw["height"], kw["num_inference_steps"], kw["true_cfg_scale"]) == (64, 32, 3, 1.0)
    cfg_cfg = cfg.model_copy(update={"negative_prompt": "blurry", "true_cfg_scale": 2.5})
    req = build_image_workload(cfg_cfg)[0]
    assert req.body(None)["negative_prompt"] == "blurry" and req.body(None)["true_cfg_scale"] == 2.5
    assert req.pipeline_kwargs()["negative_prompt"] == "blurry" and req.pipeline_kwargs()["true_cfg_scale"] == 2.5


def test_config_validation():
    assert ImageBenchConfig(url="http://x", baseline="none", concurrency=[2, 4]).cache_concurrency == 4
    with pytest.raises(ValidationError, match="needs --checkpoint"):
        ImageBenchConfig(url="http://x")
    with pytest.raises(ValidationError, match="WIDTHxHEIGHT"):
        ImageBenchConfig(url="http://x", baseline="none", size="64")
    with pytest.raises(ValidationError):
        ImageBenchConfig(url="http://x", baseline="none", cache_modes=["fast"])
    assert images_url("http://h:1") == "http://h:1/v1/images/generations"
    assert images_url("http://h:1/v1/") == "http://h:1/v1/images/generations"


def _fake_server(bodies: list):
    """Index 1 -> 400, index 2 -> 500, others: one PNG keyed by the seed, with step metrics."""
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/images/generations"
        body = json.loads(request.content)
        bodies.append(body)
        if body["seed"] == 1:
            return httpx.Response(400, json={"error": {"message": "bad size", "type": "invalid_request_error"}})
        if body["seed"] == 2:
            return httpx.Response(500, json={"error": {"message": "stage crashed", "type": "server_error"}})
        cached = 3 if (body.get("cache") or {}).get("mode") == "dbcache" else 0
        return httpx.Response(200, json={
            "created": 1, "data": [{"b64_json": _png(_pixels(body["seed"]))}],
            "metrics": {"num_inference_steps": 4, "computed_steps": [4 - cached], "cached_steps": [cached],
                        "cache_mode": body["cache"]["mode"], "true_cfg": False}})
    return handler


def test_client_against_a_fake_server_counts_errors():
    cfg = ImageBenchConfig(url="http://fake:8000", baseline="none", num_requests=4, steps=4)
    bodies: list = []
    run = asyncio.run(run_image_load(cfg.url, build_image_workload(cfg), "qwen-image", 2, cache={"mode": "off"},
                                     transport=httpx.MockTransport(_fake_server(bodies)), progress_every=0))
    assert run.label == "engine c=2" and run.cache_mode == "off" and len(run.records) == 4
    assert [r.ok for r in run.records] == [True, False, False, True] and run.num_errors == 2
    assert run.records[1].status == 400 and run.records[1].error == "HTTP 400: bad size"
    assert run.records[2].status == 500 and "stage crashed" in run.records[2].error
    good = run.records[3]
    assert np.array_equal(good.images[0], _pixels(3)) and good.computed_steps == [4] and good.cached_steps == [0]
    assert all(r.e2e_s is not None for r in run.records) and run.wall_s > 0
    assert {b["model"] for b in bodies} == {"qwen-image"}
    assert "images" not in good.to_dict() and json.dumps(run.to_dict())


def _run(label, system, concurrency, wall, records, cache_mode="off"):
    return ImageRunResult(label=label, system=system, mode="image", concurrency=concurrency, wall_s=wall,
                          streaming=False, records=records, cache_mode=cache_mode)


def _rec(i, pixels, e2e=1.0, cached=0, ok=True):
    if not ok:
        return ImageRecord(index=i, e2e_s=e2e, status=500, error="HTTP 500: boom")
    return ImageRecord(index=i, ok=True, e2e_s=e2e, num_images=1, images=[pixels], computed_steps=[4 - cached],
                       cached_steps=[cached])


def test_psnr_and_max_diff():
    a = _pixels(0, 32)
    assert psnr(a, a) == math.inf and max_abs_diff(a, a) == 0
    noise = np.where(np.random.default_rng(1).random(a.shape) < 0.5, -5, 5)
    b = np.clip(a.astype(int) + noise, 0, 255).astype(np.uint8)
    mse = np.mean((a.astype(float) - b) ** 2)
    assert psnr(a, b) == pytest.approx(10 * math.log10(255**2 / mse))
    c = np.full((4, 4, 3), 100, np.uint8)
    assert psnr(c, c + 5) == pytest.approx(10 * math.log10(255**2 / 25))  # = 34.15 dB
    assert max_abs_diff(c, c + 5) == 5
    with pytest.raises(ValueError):
        psnr(a, a[:4])


def test_report_ratios_parity_and_cache(tmp_path):
    px = [_pixels(i) for i in range(4)]
    off1 = _run("engine c=1", "engine", 1, 4.0, [_rec(i, px[i]) for i in range(4)])
    off2 = _run("engine c=2", "engine", 2, 2.0, [_rec(i, px[i], e2e=1.5) for i in range(3)] + [_rec(3, None, ok=False)])
    near = [np.clip(p.astype(int) + 1, 0, 255).astype(np.uint8) for p in px]
    base = _run("diffusers", "diffusers", 1, 8.0, [_rec(i, near[i], e2e=2.0) for i in range(4)])
    c = np.full((8, 8, 3), 100, np.uint8)
    cached_px = [px[0], c, px[2], px[3]]
    cached_ref = [px[0], c + 5, px[2], px[3]]
    off2.records[1].images = [cached_ref[1]]
    dbc = _run("engine dbcache c=2", "engine", 2, 1.0, [_rec(i, cached_px[i], cached=2) for i in range(4)], "dbcache")
    report = build_image_report([off1, off2, dbc, base], config={"x": 1})
    runs = {s["label"]: s for s in report["runs"]}
    assert runs["engine c=1"]["throughput"] == {"images_per_s": 1.0, "requests_per_s": 1.0}
    assert runs["engine c=2"]["num_errors"] == 1 and runs["engine c=2"]["throughput"]["images_per_s"] == 1.5
    assert runs["diffusers"]["latency_s"]["e2e"]["p50"] == 2.0
    assert runs["engine dbcache c=2"]["cached_steps_per_image"]["mean"] == 2
    ratios = {c["engine"]: c for c in report["comparisons"]}
    assert set(ratios) == {"engine c=1", "engine c=2"}  # cached runs are not compared with the baseline
    assert ratios["engine c=1"]["throughput_ratio"]["images_per_s"] == pytest.approx(2.0)
    assert ratios["engine c=2"]["throughput_ratio"]["images_per_s"] == pytest.approx(3.0)
    assert ratios["engine c=1"]["e2e_ratio"]["p50"] == pytest.approx(0.5)
    par = report["parity"]
    assert par["engine"] == "engine c=1" and par["compared"] == 4 and par["max_abs_diff"] == 1 and par["ok"]
    (cache,) = report["cache"]
    assert cache["reference"] == "engine c=2" and cache["speedup_vs_uncached"] == pytest.approx(4 / 1.5)
    assert cache["cached_fraction"] == pytest.approx(0.5)
    p = cache["psnr_db"]
    assert p["compared"] == 3 and p["identical"] == 2 and p["mean"] == math.inf  # request 3 failed in the reference
    assert p["min"] == pytest.approx(10 * math.log10(255**2 / 25)) == p["mean_finite"]
    table = format_image_table(report)
    assert "engine dbcache c=2" in table and "OK" in table and "inf" in table and "1 x HTTP 500: boom" in table
    json_path, png_path = write_image_report(report, [off1, off2, dbc, base], str(tmp_path))
    data = json.loads(Path(json_path).read_text())  # strict JSON: no Infinity / NaN
    assert data["cache"][0]["psnr_db"]["mean"] is None and data["cache"][0]["psnr_db"]["per_request"]["0"] is None
    assert Path(png_path).read_bytes()[:4] == b"\x89PNG"


def test_diffusers_baseline_on_the_tiny_checkpoint(qwen_image_tiny_dir):
    cfg = ImageBenchConfig(url="http://x", checkpoint=qwen_image_tiny_dir, num_requests=2, size="64x64", steps=2)
    requests = build_image_workload(cfg)
    baseline = DiffusersImageBaseline(qwen_image_tiny_dir, load_qwen_image, threads=2)
    run = baseline.run(requests, warmup=0, progress_every=0)
    assert run.system == "diffusers" and run.num_errors == 0 and run.concurrency == 1
    for rec in run.records:
        assert rec.images[0].shape == (64, 64, 3) and rec.images[0].dtype == np.uint8
        assert rec.computed_steps == [2] and rec.cached_steps == [0]
    again = baseline.run_one(requests[0])  # same seed -> same image
    assert np.array_equal(again.images[0], run.records[0].images[0])
    assert not np.array_equal(run.records[0].images[0], run.records[1].images[0])


def test_cli_image_arguments(capsys, monkeypatch):
    captured = {}
    monkeypatch.setattr("omni_serve.bench.image.run_image_bench",
                        lambda cfg, baseline: captured.update(cfg=cfg, baseline=baseline))
    monkeypatch.setattr("omni_serve.bench.cli.finish", lambda outcome: 0)
    assert main(["bench", "--mode", "image", "--url", "http://h:1", "--checkpoint", "/ckpt", "--size", "64x64",
                 "--steps", "4", "--n", "2", "--true-cfg-scale", "3", "--negative-prompt", "ugly",
                 "--cache-modes", "dbcache,taylorseer", "--cache-threshold", "0.3", "--concurrency", "1,4"]) == 0
    cfg = captured["cfg"]
    assert (cfg.baseline, cfg.size, cfg.steps, cfg.n, cfg.true_cfg_scale, cfg.negative_prompt) == (
        "diffusers", "64x64", 4, 2, 3.0, "ugly")
    assert cfg.cache_modes == ["dbcache", "taylorseer"] and cfg.cache_threshold == 0.3
    assert cfg.concurrency == [1, 4] and cfg.cache_concurrency == 4
    captured.clear()
    assert main(["bench", "--mode", "image", "--url", "http://h:1", "--cache-modes", "none"]) == 0
    cfg = captured["cfg"]
    assert cfg.baseline == "none" and cfg.cache_modes == [] and cfg.concurrency == [1, 8] and cfg.steps == 20
    assert main(["bench", "--mode", "image", "--url", "http://h:1", "--baseline", "hf"]) == 2
    assert "diffusers or none" in capsys.readouterr().err
    assert main(["bench", "--mode", "image", "--url", "http://h:1", "--baseline", "diffusers"]) == 2
    assert "needs --checkpoint" in capsys.readouterr().err
    assert main(["bench", "--mode", "image", "--url", "http://h:1", "--request-rate", "2"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--mode", "image", "--url", "http://h:1", "--cache-modes", "fast"])


def test_edits_workload_sends_each_request_its_input_image_as_a_form():
    cfg = ImageBenchConfig(url="http://fake:8000", baseline="none", endpoint="edits", input_size="40x24",
                           num_requests=3, steps=2, size="64x64")
    requests = build_image_workload(cfg)
    assert requests == build_image_workload(cfg) and all(r.input_image for r in requests)
    assert len({r.input_image for r in requests}) == 3  # one input image per request (its seed)
    from PIL import Image

    assert Image.open(io.BytesIO(requests[0].input_image)).size == (40, 24)
    fields, files = requests[0].form("qwen-image-edit", {"mode": "dbcache", "residual_diff_threshold": 0.2})
    assert fields["cache[mode]"] == "dbcache" and fields["cache[residual_diff_threshold]"] == "0.2"
    assert fields["seed"] == "0" and fields["size"] == "64x64" and "cache" not in fields
    assert files["image"][1] == requests[0].input_image
    assert images_url("http://h:1", "edits") == "http://h:1/v1/images/edits"
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/images/edits"
        assert request.headers["content-type"].startswith("multipart/form-data")
        seen.append(request.content)
        return httpx.Response(200, json={"created": 1, "data": [{"b64_json": _png(_pixels(len(seen)))}],
                                         "metrics": {"computed_steps": [2], "cached_steps": [0], "cache_mode": "off"}})
    run = asyncio.run(run_image_load(cfg.url, requests, "qwen-image-edit", 2, cache={"mode": "off"},
                                     transport=httpx.MockTransport(handler), progress_every=0))
    assert run.num_errors == 0 and len(seen) == 3
    assert all(b'name="image"; filename="input.png"' in body and b'name="cache[mode]"' in body for body in seen)


def test_diffusers_edit_baseline_on_the_tiny_checkpoint():
    from tests.conftest import tiny_checkpoint

    checkpoint = tiny_checkpoint("qwen_image_edit")
    cfg = ImageBenchConfig(url="http://x", checkpoint=checkpoint, endpoint="edits", input_size="32x32",
                           num_requests=1, size="64x64", steps=1)
    [request] = build_image_workload(cfg)
    rec = DiffusersImageBaseline(checkpoint, load_qwen_image_edit, threads=2).run_one(request)
    assert rec.ok and rec.images[0].shape == (64, 64, 3)


def test_cli_image_edits_arguments(monkeypatch):
    captured = {}
    monkeypatch.setattr("omni_serve.bench.image.run_image_bench",
                        lambda cfg, baseline: captured.update(cfg=cfg, baseline=baseline))
    monkeypatch.setattr("omni_serve.bench.cli.finish", lambda outcome: 0)
    assert main(["bench", "--mode", "image", "--url", "http://h:1", "--endpoint", "edits", "--input-size", "96x64",
                 "--cache-modes", "none"]) == 0
    assert captured["cfg"].endpoint == "edits" and captured["cfg"].input_size == "96x64"
