"""omni_serve.bench: workload determinism, statistics/throughput/ratio math, report files (no Ray, no model)."""

from __future__ import annotations

import json
import math

import pytest

from omni_serve.bench.client import poisson_arrivals
from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.report import (
    build_report, compare, format_table, percentile, stats, summarize, write_report,
)
from omni_serve.bench.workload import PROMPT_LEADS, WorkloadConfig, build_workload

# --------------------------------------------------------------------------- workload


def test_workload_is_deterministic_and_seed_dependent():
    cfg = WorkloadConfig(num_requests=20, seed=3, max_tokens=17)
    a, b = build_workload(cfg), build_workload(cfg)
    assert a == b
    other = build_workload(WorkloadConfig(num_requests=20, seed=4, max_tokens=17))
    assert [r.prompt for r in a] != [r.prompt for r in other]
    assert [r.index for r in a] == list(range(20))
    assert len({r.seed for r in a}) == 20
    lengths = {len(r.prompt.split()) for r in a}
    assert len(lengths) > 3  # prompts of varying length


def test_workload_prompt_lengths_stay_in_bounds():
    reqs = build_workload(WorkloadConfig(num_requests=50, min_words=3, max_words=5))
    for r in reqs:
        lead = next(lead for lead in PROMPT_LEADS if r.prompt.startswith(lead + " "))
        words = r.prompt[len(lead):].rstrip(".").split()
        assert 3 <= len(words) <= 5


def test_request_body_audio_and_text_only():
    r = build_workload(WorkloadConfig(num_requests=1, audio=True, voice="Ethan", max_tokens=9, temperature=0))[0]
    body = r.body("m")
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["modalities"] == ["text", "audio"]
    assert body["audio"] == {"voice": "Ethan", "format": "pcm16"}
    assert body["max_tokens"] == 9 and body["temperature"] == 0 and body["seed"] == r.seed
    assert body["messages"] == [{"role": "user", "content": r.prompt}]
    t = build_workload(WorkloadConfig(num_requests=1, audio=False))[0].body("m", include_usage=False)
    assert t["modalities"] == ["text"] and "audio" not in t and "stream_options" not in t
    assert "min_tokens" not in t
    fixed = build_workload(WorkloadConfig(num_requests=1, max_tokens=9, min_tokens=9))[0].body("m")
    assert fixed["min_tokens"] == 9 and fixed["max_tokens"] == 9


def test_workload_validation():
    with pytest.raises(ValueError):
        WorkloadConfig(num_requests=0)
    with pytest.raises(ValueError):
        WorkloadConfig(min_words=5, max_words=4)
    with pytest.raises(ValueError):
        WorkloadConfig(max_tokens=4, min_tokens=5)


def test_poisson_arrivals_seeded():
    a = poisson_arrivals(200, rate=4.0, seed=1)
    assert a == poisson_arrivals(200, rate=4.0, seed=1)
    assert a != poisson_arrivals(200, rate=4.0, seed=2)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    mean_gap = a[-1] / (len(a) - 1)
    assert 0.15 < mean_gap < 0.4  # 1/rate = 0.25 s


# --------------------------------------------------------------------------- statistics


def test_percentiles_match_linear_interpolation():
    vals = list(range(1, 101))  # 1..100
    s = stats([float(v) for v in reversed(vals)])
    assert s["n"] == 100 and s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p95"] == pytest.approx(95.05)
    assert s["p99"] == pytest.approx(99.01)
    assert percentile([2.0], 99) == 2.0
    assert stats([]) is None
    assert stats([None, 1.0])["n"] == 1


def _rec(i, e2e, ttft, tokens, audio=0.0, ttfp=None, itl=(), ok=True, error=None, source="usage"):
    return RequestRecord(index=i, ok=ok, e2e_s=e2e, ttft_s=ttft, ttfp_s=ttfp, itl_s=list(itl), output_tokens=tokens,
                         token_source=source, audio_seconds=audio, error=error, status=200 if ok else 500)


def _engine_run():
    records = [
        _rec(0, 1.0, 0.1, 10, audio=2.0, ttfp=0.5, itl=(0.1, 0.2)),
        _rec(1, 2.0, 0.2, 20, audio=4.0, ttfp=0.7, itl=(0.3,)),
        _rec(2, 3.0, 0.3, 30, audio=2.0, ttfp=0.9),
        _rec(3, 0.4, None, None, ok=False, error="HTTP 500: boom"),
    ]
    return RunResult(label="engine c=2", system="engine", concurrency=2, wall_s=4.0, records=records)


def test_summarize_throughput_and_errors():
    s = summarize(_engine_run())
    assert s["num_requests"] == 4 and s["num_ok"] == 3 and s["num_errors"] == 1
    assert s["errors_by_message"] == {"HTTP 500: boom": 1}
    assert s["errors"][0] == {"index": 3, "status": 500, "error": "HTTP 500: boom"}
    t = s["throughput"]
    assert t["requests_per_s"] == pytest.approx(3 / 4.0)
    assert t["output_tokens_per_s"] == pytest.approx(60 / 4.0)
    assert t["audio_s_per_s"] == pytest.approx(8.0 / 4.0)
    lat = s["latency_s"]
    assert lat["e2e"]["n"] == 3 and lat["e2e"]["p50"] == pytest.approx(2.0)  # the failure is left out
    assert lat["ttft"]["mean"] == pytest.approx(0.2)
    assert lat["ttfp"]["p50"] == pytest.approx(0.7)
    assert lat["itl"]["n"] == 3 and lat["itl"]["mean"] == pytest.approx(0.2)
    # RTF per request: 1/2, 2/4, 3/2
    assert lat["rtf"]["n"] == 3 and lat["rtf"]["p50"] == pytest.approx(0.5)
    assert lat["rtf"]["mean"] == pytest.approx((0.5 + 0.5 + 1.5) / 3)
    assert s["tokens_exact"] is True and s["token_sources"] == {"usage": 3}


def test_summarize_flags_approximate_token_counts_and_no_audio():
    run = RunResult(label="x", system="engine", wall_s=1.0,
                    records=[_rec(0, 1.0, 0.1, 5, source="deltas"), _rec(1, 1.0, 0.1, 5)])
    s = summarize(run)
    assert s["tokens_exact"] is False
    assert s["throughput"]["audio_s_per_s"] is None
    assert s["latency_s"]["rtf"] is None and s["latency_s"]["ttfp"] is None


def test_compare_ratios():
    engine = summarize(_engine_run())
    base = summarize(RunResult(label="hf", system="hf", concurrency=1, wall_s=12.0, streaming=False, records=[
        _rec(i, 4.0, 4.0, 20, audio=2.0, ttfp=4.0) for i in range(3)]))
    c = compare(engine, base)
    assert c["engine"] == "engine c=2" and c["baseline"] == "hf"
    assert c["throughput_ratio"]["requests_per_s"] == pytest.approx((3 / 4) / (3 / 12))
    assert c["throughput_ratio"]["output_tokens_per_s"] == pytest.approx(15.0 / 5.0)
    assert c["throughput_ratio"]["audio_s_per_s"] == pytest.approx(2.0 / 0.5)
    assert c["latency_ratio"]["e2e"]["p50"] == pytest.approx(2.0 / 4.0)
    assert c["latency_ratio"]["ttft"]["mean"] == pytest.approx(0.2 / 4.0)
    assert "itl" not in c["latency_ratio"]  # the baseline has no ITL


def test_build_report_pairs_runs_by_concurrency():
    runs = [
        RunResult(label="engine_text c=1", system="engine_text", mode="text", concurrency=1, wall_s=1.0,
                  records=[_rec(0, 1.0, 0.1, 10)]),
        RunResult(label="engine_text c=4", system="engine_text", mode="text", concurrency=4, wall_s=1.0,
                  records=[_rec(0, 1.0, 0.1, 40)]),
        RunResult(label="cb c=1", system="cb", mode="text", concurrency=1, wall_s=2.0, records=[_rec(0, 1.0, 0.1, 10)]),
        RunResult(label="cb c=4", system="cb", mode="text", concurrency=4, wall_s=2.0, records=[_rec(0, 1.0, 0.1, 40)]),
    ]
    rep = build_report(runs)
    pairs = {(c["engine"], c["baseline"]) for c in rep["comparisons"]}
    assert pairs == {("engine_text c=1", "cb c=1"), ("engine_text c=4", "cb c=4")}
    for c in rep["comparisons"]:
        assert c["throughput_ratio"]["output_tokens_per_s"] == pytest.approx(2.0)


def test_single_baseline_is_compared_with_every_engine_run():
    runs = [_engine_run(), RunResult(label="engine c=8", system="engine", concurrency=8, wall_s=1.0,
                                     records=[_rec(0, 1.0, 0.1, 5, audio=1.0, ttfp=0.5)]),
            RunResult(label="hf", system="hf", concurrency=1, wall_s=3.0, streaming=False,
                      records=[_rec(0, 3.0, 3.0, 5, audio=1.0, ttfp=3.0)])]
    rep = build_report(runs, config={"k": 1}, notes=["hello"])
    assert {c["engine"] for c in rep["comparisons"]} == {"engine c=2", "engine c=8"}
    assert all(c["baseline"] == "hf" for c in rep["comparisons"])
    assert "hello" in rep["notes"]
    assert any("TTFT and TTFP equal the E2E" in n for n in rep["notes"])
    text = format_table(rep)
    for needle in ("engine c=2", "engine c=8", "hf", "E2E p50 x", "HTTP 500: boom", "ttfp (ms)", "rtf (x)"):
        assert needle in text


def test_write_report_json_and_png(tmp_path):
    runs = [_engine_run(), RunResult(label="hf", system="hf", concurrency=1, wall_s=12.0, streaming=False,
                                     records=[_rec(i, 4.0, 4.0, 20, audio=2.0, ttfp=4.0) for i in range(3)])]
    rep = build_report(runs, config={"num_requests": 4})
    json_path, png_path = write_report(rep, runs, str(tmp_path / "out"))
    data = json.loads(open(json_path).read())
    assert data["config"] == {"num_requests": 4}
    assert [r["label"] for r in data["runs"]] == ["engine c=2", "hf"]
    assert data["runs"][0]["num_errors"] == 1
    assert len(data["records"]["engine c=2"]) == 4
    assert math.isclose(data["comparisons"][0]["latency_ratio"]["e2e"]["p50"], 0.5)
    back = [_as_run(data, r) for r in data["runs"]]
    assert back[0].records[3].error == "HTTP 500: boom"
    with open(png_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _as_run(data, summary) -> RunResult:
    return RunResult(label=summary["label"], system=summary["system"], concurrency=summary["concurrency"],
                     wall_s=summary["wall_s"],
                     records=[RequestRecord.from_dict(r) for r in data["records"][summary["label"]]])


def test_closed_and_open_loop_runs_of_one_system_plot_on_the_concurrency_axis(tmp_path, monkeypatch):
    import matplotlib.axes

    from omni_serve.bench import report

    closed = [RunResult(label=f"engine c={c}", system="engine", concurrency=c, wall_s=2.0,
                        records=[_rec(i, 1.0, 0.5, 10, audio=1.0, ttfp=0.5) for i in range(2)]) for c in (1, 4)]
    poisson = RunResult(label="engine rate=1/s cap=4", system="engine", concurrency=4, request_rate=1.0, wall_s=2.0,
                        records=[_rec(i, 1.0, 0.5, 10, audio=1.0, ttfp=0.5) for i in range(2)])
    runs = closed + [poisson]
    assert report._x_kind(runs) == "concurrency" and report._x_kind([poisson]) == "rate"
    plotted, flat = [], []
    plot, axhline = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.axhline

    def recorded(ax, xs, ys, *a, **k):
        plotted.append((list(xs), k.get("label")))
        return plot(ax, xs, ys, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recorded)
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline",
                        lambda ax, *a, **k: flat.append(k.get("label")) or axhline(ax, *a, **k))
    write_report(build_report(runs), runs, str(tmp_path))
    # the vs-load panels draw the closed-loop points at their concurrency, not as a flat "sequential" line; the
    # Poisson run is left off them
    assert ([1, 4], "engine") in plotted and ([1, 4], "engine p50") in plotted, plotted
    assert not any(label and label.startswith("engine") for label in flat), flat


def test_write_report_handles_runs_without_successes(tmp_path):
    runs = [RunResult(label="engine c=1", system="engine", concurrency=1, wall_s=0.5,
                      records=[_rec(0, 0.1, None, None, ok=False, error="transport error: ConnectError")])]
    rep = build_report(runs)
    json_path, png_path = write_report(rep, runs, str(tmp_path))
    assert rep["runs"][0]["throughput"]["requests_per_s"] == 0
    assert rep["runs"][0]["latency_s"]["e2e"] is None
    assert "transport error" in format_table(rep)


def test_identical_text_is_counted_per_request():
    def run(label, system, digests):
        return RunResult(label=label, system=system, concurrency=1, wall_s=1.0, records=[
            RequestRecord(index=i, ok=True, e2e_s=1.0, output_tokens=1, token_source="usage", text_sha1=d)
            for i, d in enumerate(digests)])
    rep = build_report([run("engine c=1", "engine", ["a", "b", "c"]), run("hf", "hf", ["a", "x", "c"])])
    assert rep["comparisons"][0]["identical_text"] == {"compared": 3, "identical": 2}
    assert "2/3" in format_table(rep)
