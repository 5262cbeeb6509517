"""``omni-serve bench --mode transcription`` (the qwen3_asr bench) without Ray or a server: the plug-in's wiring and
flags, the workload, the upload client against a fake transcriptions endpoint (httpx.MockTransport), the report
maths, the transformers baseline on the tiny checkpoint (window tokens equal to the tests' reference), and the
ceiling script's reading of the serve config."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from pydantic import ValidationError

from omni_serve.bench.transcription import (
    TranscriptionBenchConfig, TranscriptionRecord, TranscriptionRunResult, build_transcription_report,
    build_transcription_workload, format_transcription_table, run_transcription_load, synth_clip,
    transcriptions_url, write_transcription_report,
)
from omni_serve.cli import main


def test_the_qwen3_asr_bench_is_registered_with_its_transcription_mode(capsys):
    from omni_serve.bench.plugins import benches, resolve

    assert list(benches()["qwen3_asr"].modes) == ["transcription"]
    assert resolve(None, "transcription").family == "qwen3_asr" and resolve("qwen3_asr", None).family == "qwen3_asr"
    with pytest.raises(SystemExit):
        main(["bench", "--graph", "qwen3_asr", "--help"])
    text = capsys.readouterr().out
    for flag in ("--audio-seconds", "--language", "--max-tokens", "--window-seconds", "--window-search-seconds",
                 "--agreement-requests"):
        assert flag in text
    assert "--num-frames" not in text  # the video mode's flags are not the transcription mode's


def test_cli_transcription_arguments(capsys, monkeypatch):
    captured = {}
    monkeypatch.setattr("omni_serve.bench.transcription.run_transcription_bench",
                        lambda cfg, baseline: captured.update(cfg=cfg, baseline=baseline))
    monkeypatch.setattr("omni_serve.bench.cli.finish", lambda outcome: 0)
    assert main(["bench", "--mode", "transcription", "--url", "http://h:1", "--checkpoint", "/ckpt",
                 "--audio-seconds", "4.5", "--language", "English", "--prompt", "names", "--max-tokens", "40",
                 "--window-seconds", "3", "--window-search-seconds", "1", "--agreement-requests", "2",
                 "--concurrency", "1,8", "--num-requests", "6", "--threads", "2", "--stop-server-pid", "123",
                 "--no-calibration"]) == 0
    cfg = captured["cfg"]
    assert (cfg.baseline, cfg.audio_seconds, cfg.language, cfg.prompt, cfg.max_tokens, cfg.window_seconds,
            cfg.window_search_seconds, cfg.agreement_requests) == ("transformers", 4.5, "English", "names", 40, 3.0,
                                                                    1.0, 2)
    assert (cfg.concurrency, cfg.num_requests, cfg.threads, cfg.stop_server_pid, cfg.calibrate) == (
        [1, 8], 6, 2, 123, False)
    assert callable(captured["baseline"])
    captured.clear()
    assert main(["bench", "--graph", "qwen3_asr", "--url", "http://h:1", "--language", "none"]) == 0
    cfg = captured["cfg"]  # the family's first mode, its defaults; no baseline: no agreement pass
    assert (cfg.baseline, cfg.concurrency, cfg.audio_seconds, cfg.language, cfg.max_tokens, cfg.window_seconds,
            cfg.agreement_requests) == ("none", [1, 8], 10.0, None, 512, 30.0, 0)
    for argv, message in [([], "needs --url"), (["--baseline", "hf"], "transformers or none"),
                          (["--baseline", "transformers"], "--checkpoint"),
                          (["--request-rate", "1"], "closed loops only"),
                          (["--window-seconds", "3", "--window-search-seconds", "3"], "window_search_seconds"),
                          (["--audio-seconds", "0"], "greater than 0")]:
        url = [] if message == "needs --url" else ["--url", "http://h:1"]
        assert main(["bench", "--mode", "transcription", *url, *argv]) == 2, argv
        assert message in capsys.readouterr().err


def test_workload_clips_are_seeded_wavs_and_forms():
    cfg = TranscriptionBenchConfig(url="http://x", baseline="none", num_requests=3, seed=5, audio_seconds=2.5,
                                   prompt="hotwords")
    a = build_transcription_workload(cfg)
    assert a == build_transcription_workload(cfg) and [r.seed for r in a] == [5, 6, 7]
    samples, rate = sf.read(io.BytesIO(a[0].wav), dtype="float32")
    assert rate == 16000 and samples.shape == (40000,) and a[0].seconds == 2.5
    assert np.abs(samples - synth_clip(2.5, 5)).max() < 1e-4  # 16-bit PCM of the clip
    assert (np.abs(samples) < 1e-4).mean() > 0.2  # quiet gaps
    assert len({r.wav for r in a}) == 3
    assert a[0].form("qwen3-asr", stream=True) == {"response_format": "json", "stream": "true", "model": "qwen3-asr",
                                                    "language": "en", "prompt": "hotwords"}
    assert a[0].form(None, stream=False, response_format="verbose_json") == {
        "response_format": "verbose_json", "language": "en", "prompt": "hotwords"}
    assert a[1].files()["file"][0] == "clip1.wav"
    assert transcriptions_url("http://h:1") == transcriptions_url("http://h:1/v1/") == \
        "http://h:1/v1/audio/transcriptions"
    with pytest.raises(ValidationError, match="needs --checkpoint"):
        TranscriptionBenchConfig(url="http://x")


def _sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events)


def _fake_transcriptions(seen: list):
    """By the uploaded file's name: clip1 a 429, clip2 an error event mid-stream, clip3 a stream without its done
    event; the others stream three deltas (the first empty) and the done event, or answer verbose_json."""

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/audio/transcriptions"
        body = request.content
        seen.append(body)
        name = next(n for n in (b"clip0", b"clip1", b"clip2", b"clip3", b"clip4") if n + b".wav" in body)
        if name == b"clip1":
            return httpx.Response(429, json={"error": {"message": "too many requests", "type": "rate_limit"}})
        if b'name="response_format"\r\n\r\nverbose_json' in body:
            return httpx.Response(200, json={"task": "transcribe", "language": "en", "duration": 1.0, "text": "ab cd",
                                             "segments": [{"start": 0, "end": 1, "text": "ab cd", "tokens": [5, 6],
                                                           "temperature": 0}]})
        deltas = [{"type": "transcript.text.delta", "delta": d} for d in ("", "ab", " cd")]
        if name == b"clip2":
            return httpx.Response(200, content=_sse(deltas[1], {"error": {"message": "stage died"}}))
        done = [] if name == b"clip3" else [{"type": "transcript.text.done", "text": "ab cd",
                                             "usage": {"type": "tokens", "input_tokens": 9, "output_tokens": 4,
                                                       "total_tokens": 13}}]
        return httpx.Response(200, content=_sse(*deltas, *done), headers={"content-type": "text/event-stream"})
    return handler


def test_the_upload_client_streams_times_and_counts_failures():
    cfg = TranscriptionBenchConfig(url="http://fake:8000", baseline="none", num_requests=5, audio_seconds=1.0)
    requests = build_transcription_workload(cfg)
    seen: list = []
    run = asyncio.run(run_transcription_load(cfg.url, requests, "qwen3-asr", 2, progress_every=0,
                                             transport=httpx.MockTransport(_fake_transcriptions(seen))))
    assert run.label == "engine c=2" and run.mode == "transcription" and run.streaming and len(run.records) == 5
    ok, rejected, errored, cut, good = run.records
    assert [r.ok for r in run.records] == [True, False, False, False, True]
    assert run.num_errors == 2 and run.num_rejected == 1
    assert rejected.status == 429 and rejected.rejected and rejected.error == "HTTP 429: too many requests"
    assert errored.error == "stream error: stage died"
    assert cut.error == "stream ended without transcript.text.done"
    for rec in (ok, good):
        assert rec.text == "ab cd" and rec.output_tokens == 4 and rec.token_source == "usage"
        assert rec.text_deltas == 2 and len(rec.itl_s) == 1 and 0 < rec.ttft_s <= rec.e2e_s
        assert rec.audio_seconds == 1.0 and rec.window_tokens is None
    assert all(b'name="stream"\r\n\r\ntrue' in body and b'name="model"\r\n\r\nqwen3-asr' in body for body in seen)
    assert json.dumps(run.to_dict())
    verbose = asyncio.run(run_transcription_load(cfg.url, requests[:1], None, 1, stream=False,
                                                 response_format="verbose_json", progress_every=0,
                                                 transport=httpx.MockTransport(_fake_transcriptions(seen))))
    rec = verbose.records[0]
    assert rec.ok and rec.window_tokens == [[5, 6]] and rec.output_tokens == 2 and rec.text == "ab cd"
    assert b'name="stream"' not in seen[-1] and not verbose.streaming


def _rec(i, e2e=1.0, ttft=0.1, ok=True, text="t", tokens=None, seconds=10.0):
    if not ok:
        return TranscriptionRecord(index=i, e2e_s=e2e, audio_seconds=seconds, error="stream error: x")
    return TranscriptionRecord(index=i, ok=True, e2e_s=e2e, ttft_s=ttft, audio_seconds=seconds, output_tokens=40,
                               token_source="usage", text=text, window_tokens=tokens)


def _run(label, system, concurrency, wall, records, streaming=True):
    return TranscriptionRunResult(label=label, system=system, mode="transcription", concurrency=concurrency,
                                  wall_s=wall, streaming=streaming, records=records)


def test_report_rates_ratios_and_agreement(tmp_path):
    c1 = _run("engine c=1", "engine", 1, 4.0, [_rec(i, 1.0, 0.2, text=f"t{i}") for i in range(4)])
    c8 = _run("engine c=8", "engine", 8, 1.0, [_rec(i, 2.0, 0.5, text=f"t{i}") for i in range(3)] + [_rec(3, ok=False)])
    agree = _run("agreement (verbose_json)", "engine", 8, 1.0,
                 [_rec(0, tokens=[[1, 2], [3]]), _rec(1, tokens=[[1, 2]]), _rec(2, tokens=[[4, 4, 9]])],
                 streaming=False)
    base = _run("transformers", "transformers", 1, 8.0,
                [_rec(i, 2.0, 0.4, text="other" if i == 2 else f"t{i}",
                      tokens=[[[1, 2], [3]], [[1, 2]], [[4, 4, 4]], [[7]]][i]) for i in range(4)], streaming=False)
    report = build_transcription_report([c1, c8, base], agree, config={"x": 1}, notes=["n"])
    runs = {s["label"]: s for s in report["runs"]}
    assert runs["engine c=1"]["throughput"] == {"requests_per_s": 1.0, "output_tokens_per_s": 40.0,
                                                "audio_s_per_s": 10.0}
    assert runs["engine c=8"]["num_errors"] == 1 and runs["engine c=8"]["throughput"]["audio_s_per_s"] == 30.0
    assert runs["engine c=8"]["latency_s"]["rtf"]["p50"] == pytest.approx(0.2)
    assert runs["transformers"]["latency_s"]["ttft"]["p50"] == pytest.approx(0.4)
    ratios = {c["engine"]: c for c in report["comparisons"]}
    assert ratios["engine c=1"]["throughput_ratio"]["requests_per_s"] == pytest.approx(2.0)
    assert ratios["engine c=8"]["throughput_ratio"]["audio_s_per_s"] == pytest.approx(6.0)
    assert ratios["engine c=8"]["latency_ratio"]["ttft"]["p50"] == pytest.approx(1.25)
    assert ratios["engine c=1"]["latency_ratio"]["rtf"]["p50"] == pytest.approx(0.5)
    a = report["agreement"]
    assert a["text"] == {"engine c=1": {"compared": 4, "identical": 3}, "engine c=8": {"compared": 3, "identical": 2}}
    assert (a["tokens"]["windows_compared"], a["tokens"]["windows_identical"]) == (4, 3)
    assert a["tokens"]["differing"] == [{"index": 2, "window": 0, "first_differing_token": 2}]
    table = format_transcription_table(report)
    assert "engine c=8" in table and "30.00" in table and "1 x stream error: x" in table and "3/4" in table
    assert "3/4 windows' tokens identical to transformers's" in table
    json_path, png_path = write_transcription_report(report, [c1, c8, base], str(tmp_path))
    data = json.loads(Path(json_path).read_text())
    assert data["runs"][0]["label"] == "engine c=1" and data["records"]["agreement (verbose_json)"][0]["window_tokens"]
    assert Path(png_path).read_bytes()[:4] == b"\x89PNG"


def test_the_transformers_baseline_on_the_tiny_checkpoint_is_the_reference(qwen3_asr_tiny_dir):
    from benchmarks.qwen3_asr.baseline import from_config
    from omni_serve.api.media import decode_audio_bytes
    from tests.asr_cases import MAX_TOKENS, SEARCH_S, WINDOW_S, Reference

    cfg = TranscriptionBenchConfig(url="http://x", checkpoint=qwen3_asr_tiny_dir, num_requests=2, audio_seconds=7.5,
                                   max_tokens=MAX_TOKENS, window_seconds=WINDOW_S, window_search_seconds=SEARCH_S,
                                   threads=1)
    requests = build_transcription_workload(cfg)
    run = from_config(cfg).run(requests, warmup=0, progress_every=0)
    assert run.system == "transformers" and run.label == "transformers" and run.num_errors == 0, run.records[0].error
    reference = Reference(qwen3_asr_tiny_dir)
    for rec, req in zip(run.records, requests):
        samples = decode_audio_bytes(req.wav, "wav", target_sr=16000, max_seconds=60, param="file")
        assert rec.window_tokens == reference.tokens(samples, language="en") and len(rec.window_tokens) == 3
        assert rec.output_tokens == sum(map(len, rec.window_tokens)) and rec.text
        assert 0 < rec.ttft_s < rec.e2e_s and 0 < rec.compute_s < rec.e2e_s and rec.audio_seconds == 7.5
    assert run.records[0].window_tokens != run.records[1].window_tokens  # negative control
    assert any("generate" in n for n in run.notes)


def test_the_ceiling_reads_each_stages_threads_from_the_serve_config(tmp_path):
    from benchmarks.qwen3_asr.ceiling import batches, stage_threads

    assert batches(8) == [1, 2, 4, 8] and batches(6) == [1, 2, 4, 6] and batches(1) == [1]
    config = tmp_path / "c.yaml"
    config.write_text("stages:\n  llm:\n    engine: {torch_threads: 2}\n")
    assert stage_threads(str(config)) == {"encoder": 1, "llm": 2}
    shipped = Path(__file__).parents[2] / "benchmarks" / "qwen3_asr" / "small.yaml"
    assert set(stage_threads(str(shipped))) == {"encoder", "llm"}
