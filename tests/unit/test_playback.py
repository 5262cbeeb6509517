"""What a listener hears (omni_serve.playback) and how the benches and the served metrics report it: stalls against
a client buffer, gaps, headroom, RTF after the first chunk, rejected requests apart from failures (no Ray, no
model)."""

from __future__ import annotations

import json

import pytest

from omni_serve.bench import speech
from omni_serve.bench.heard import heard
from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.report import build_report, format_table, write_report
from omni_serve.metrics import RequestClock
from omni_serve.playback import Playback, replay
from tests.unit.test_autoscaling import FakeClock


def test_a_chunk_after_the_buffer_ran_dry_is_a_stall_and_later_chunks_are_due_that_much_later():
    p = Playback(buffer_s=0.5, start=0.0)
    assert p.due() is None
    p.add(1.0, 0.24)  # first audio: playback starts at 1.5 and the buffer runs dry at 1.74
    assert p.due() == pytest.approx(1.74)
    p.add(1.6, 1.92)  # 0.14 s still buffered: on time
    assert p.due() == pytest.approx(3.66)
    p.add(4.5, 1.92)  # 0.84 s late: a stall, and the listener's timeline shifts by it
    assert p.due() == pytest.approx(4.5 + 1.92)
    p.add(5.0, 0.0)  # no audio: ignored
    p.add(6.0, 1.0)  # 0.42 s to spare
    f = p.figures()
    assert f.ttfp == pytest.approx(1.0) and f.chunks == 4 and f.audio_s == pytest.approx(5.08)
    assert f.stalls == 1 and f.stall_s == pytest.approx(0.84)
    assert f.headroom == pytest.approx([0.14, -0.84, 0.42]) and f.min_headroom == pytest.approx(-0.84)
    assert f.gaps == pytest.approx([0.6, 2.9, 1.5])
    assert f.rtf_after_first == pytest.approx(5.0 / 4.84)


def test_a_bigger_buffer_hides_the_same_gap_and_one_chunk_has_no_rtf_after_it():
    arrivals = [(1.0, 0.24), (1.6, 1.92), (4.5, 1.92)]
    assert replay(arrivals, 0.5).stalls == 1
    assert replay(arrivals, 1.5).stalls == 0
    assert replay(arrivals, 0.0).stalls == 2  # no buffer: the second chunk is late too
    single = replay([(0.3, 2.0)], 0.5)
    assert single.rtf_after_first is None and single.min_headroom is None and single.stalls == 0
    assert replay([], 0.5).ttfp is None
    with pytest.raises(ValueError):
        Playback(buffer_s=-1)


def test_heard_counts_stalled_streams_across_a_run():
    streams = [[[1.0, 0.24], [1.6, 1.92]], [[1.0, 0.24], [3.0, 1.0]], []]
    h = heard(streams, 0.5)
    assert h["streams"] == 2 and h["stalled_streams"] == 1 and h["stalls"] == 1
    assert h["stall_s_total"] == pytest.approx(3.0 - 1.74)
    assert h["min_headroom_s"]["p5"] == pytest.approx(-1.26) and h["chunk_gap_s"]["n"] == 2
    assert heard([[], []], 0.5) is None


def test_the_served_request_clock_follows_playback_with_the_graphs_buffer():
    clock = FakeClock()
    rc = RequestClock(clock, buffer_s=0.25)
    clock.t += 1.0
    rc.audio(0.5)
    clock.t += 1.0  # due at 1.0 + 0.25 + 0.5: 0.25 s late
    rc.audio(1.0)
    f = rc.figures()
    assert f["ttfp"] == pytest.approx(1.0) and f["playback"].stalls == 1
    assert f["playback"].stall_s == pytest.approx(0.25) and f["playback"].gaps == pytest.approx([1.0])
    assert RequestClock(clock).figures()["playback"] is None


def _chat_run(label: str, concurrency: int, chunk_times: list[list[float]]) -> RunResult:
    records = [RequestRecord(index=i, ok=True, e2e_s=times[-1] + 0.1, ttft_s=0.1, ttfp_s=times[0],
                             audio_seconds=0.5 * len(times), audio_chunks=[[t, 0.5] for t in times],
                             output_tokens=3, token_source="usage")
               for i, times in enumerate(chunk_times)]
    return RunResult(label=label, system="engine", concurrency=concurrency, wall_s=5.0, records=records,
                     client_buffer_s=0.5)


def test_the_chat_report_plays_back_every_run_and_plots_it(tmp_path):
    smooth = _chat_run("engine c=1", 1, [[0.5, 0.9, 1.3]])
    stutter = _chat_run("engine c=4", 4, [[0.5, 0.9, 1.3], [1.0, 3.0, 3.2]])
    report = build_report([smooth, stutter])
    runs = {s["label"]: s for s in report["runs"]}
    assert runs["engine c=1"]["playback"]["stalled_streams"] == 0
    assert runs["engine c=4"]["playback"]["stalled_streams"] == 1
    table = format_table(report)
    assert "Playback" in table and "engine c=4" in table.split("Playback")[1]
    json_path, png_path = write_report(report, [smooth, stutter], str(tmp_path))
    assert json.load(open(json_path))["runs"][1]["playback"]["stalls"] == 1
    assert (tmp_path / "bench_report.png").stat().st_size > 0
    again = RunResult.from_dict(stutter.to_dict())
    assert again.client_buffer_s == 0.5 and again.records[1].audio_chunks == [[1.0, 0.5], [3.0, 0.5], [3.2, 0.5]]


def test_the_speech_report_counts_429s_as_rejected_and_shows_what_listeners_heard(tmp_path, monkeypatch):
    served = speech.SpeechRecord(ok=True, ttfp_s=0.4, e2e_s=3.0, audio_s=2.0, status=200,
                                 audio_chunks=[[0.4, 0.24], [2.0, 1.76]])
    rejected = speech.SpeechRecord(ok=False, e2e_s=0.01, status=429, error="429: at capacity")
    broken = speech.SpeechRecord(ok=False, e2e_s=0.01, status=500, error="500")
    point = speech.SpeechPoint("engine", 4, 3.0, [served, rejected, broken], request_rate=2.0, client_buffer_s=0.5)
    row = point.summary()
    assert row["rejected"] == 1 and row["failed"] == 1 and row["stalled_streams"] == 1
    assert point.label == "engine_c4_r2"
    monkeypatch.setattr(speech, "run_engine", lambda cfg, texts: [point])
    cfg = speech.SpeechBenchConfig(url="http://x", num_requests=3, concurrency=[4], request_rate=[2.0],
                                   baseline="none", out=str(tmp_path), calibrate=False)
    report = speech.run_speech_bench(cfg)
    text = speech.format_report(report)
    assert "rate=2/s" in text and "playback" in text
    assert (tmp_path / "speech_bench_report.png").stat().st_size > 0
    assert json.load(open(tmp_path / "speech_bench_report.json"))["records"]["engine_c4_r2"][1]["status"] == 429


def test_the_speech_bench_sends_a_rejected_text_again_after_its_retry_after():
    import asyncio

    import httpx

    answers = iter([429, 429, 200])
    pcm = b"\x00\x01" * 2400  # 0.1 s

    def server(request: httpx.Request) -> httpx.Response:
        status = next(answers)
        if status == 429:
            return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"type": "rate_limit_error"}})
        return httpx.Response(200, stream=httpx.ByteStream(pcm))

    cfg = speech.SpeechBenchConfig(url="http://x", baseline="none")

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await speech._speak_until_admitted(client, cfg, {"input": "hi"})

    rec = asyncio.run(main())
    assert rec.ok and rec.rejections == 2 and rec.audio_s == pytest.approx(0.1) and rec.waited_s >= 0
    no_retry = cfg.model_copy(update={"retry_rejected": False})
    answers = iter([429])

    async def once():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as client:
            return await speech._speak_until_admitted(client, no_retry, {"input": "hi"})

    rec = asyncio.run(once())
    assert rec.rejected and rec.rejections == 1 and not rec.ok
