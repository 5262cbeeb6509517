"""Benchmark statistics, engine-vs-baseline ratios, and the JSON / PNG / stdout outputs.

Contract:

* ``stats(values)`` (``omni_serve.bench.stats``) -> ``{"n", "mean", "p50", "p95", "p99"}`` (linear-interpolated
  percentiles) or None when there are no values.
* ``summarize(run)`` -> per-run dict: latency stats in seconds of ``ttft``, ``ttfp``, ``itl``, ``e2e`` and
  ``rtf`` (E2E / audio seconds, per request with audio; unitless) over successful requests only; ``playback``,
  what listeners with the run's ``client_buffer_s`` heard (``omni_serve.bench.heard``: stalls, chunk gaps,
  headroom, RTF after the first chunk; None for a run without streamed audio);
  throughput over the run's wall time (``requests_per_s``, ``output_tokens_per_s``, ``audio_s_per_s``;
  successful requests only; ``audio_s_per_s`` is None when no audio came back); the error count (failed
  requests are counted and listed by message); the 429s apart from them (``num_rejected``: requests that ended
  rejected; ``rejections``: every 429, retried ones too; ``waited_s``: stats of the time served requests waited
  before their admitted try, None when none waited); how output tokens were counted.
* ``compare(engine, baseline)``: ``throughput_ratio`` = engine / baseline (> 1: the engine serves more)
  and ``latency_ratio`` = engine / baseline per metric and statistic (< 1: the engine is faster).
  With the runs it also counts requests whose output text is identical (``identical_text``; expected
  for greedy requests). ``build_report`` pairs every engine-side run (``ENGINE_SYSTEMS``: ``engine`` and
  ``engine_vllm``, the served graph with a native / vLLM thinker; ``engine_text`` and ``vllm``, the thinker
  alone on the native engine / on vLLM) with each baseline system (``hf``, ``cb``), and each vLLM run with its
  native counterpart (``VLLM_NATIVE``: ``vllm`` / ``engine_text``, ``engine_vllm`` / ``engine``): the run at
  the same concurrency and rate, else that system's only run.
* ``merge_reports(reports)`` rebuilds the runs of several reports of the same workload (e.g. one per served
  thinker backend, the ``hf`` baseline in one of them) and reports them together (``python -m
  omni_serve.bench.report merge OUT_DIR REPORT...`` writes it like ``write_report``).
* ``write_report(report, runs, out_dir)`` writes ``bench_report.json`` and ``bench_report.png``
  (matplotlib, Agg backend) and returns both paths; ``format_table(report)`` is the stdout text.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from omni_serve.bench.heard import HEARD_HEADER, heard, heard_rows
from omni_serve.bench.machine import machine_section
from omni_serve.bench.records import EXACT_TOKEN_SOURCES, RequestRecord, RunResult
from omni_serve.bench.stats import percentile, stats  # noqa: F401 - stats is the report's (image_report imports it)

METRICS = ("ttft", "ttfp", "itl", "e2e", "rtf")
THROUGHPUTS = ("requests_per_s", "output_tokens_per_s", "audio_s_per_s")
ENGINE_SYSTEMS = ("engine", "engine_vllm", "engine_text", "vllm")
BASELINE_SYSTEMS = ("hf", "cb")
VLLM_NATIVE = {"vllm": "engine_text", "engine_vllm": "engine"}  # a vLLM-thinker system -> its native counterpart
#: config keys that must agree for reports to be merged (the workload and what each request asks for)
WORKLOAD_KEYS = ("mode", "num_requests", "seed", "max_tokens", "min_tokens", "audio", "voice", "temperature",
                 "min_words", "max_words", "system_prompt")


def metric_values(run: RunResult) -> dict[str, list[float]]:
    ok = [r for r in run.records if r.ok]
    return {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "ttfp": [r.ttfp_s for r in ok if r.ttfp_s is not None],
        "itl": [g for r in ok for g in r.itl_s],
        "e2e": [r.e2e_s for r in ok if r.e2e_s is not None],
        "rtf": [r.e2e_s / r.audio_seconds for r in ok if r.e2e_s is not None and r.audio_seconds > 0],
    }


def summarize(run: RunResult) -> dict[str, Any]:
    ok = [r for r in run.records if r.ok]
    rejected = [r for r in run.records if r.rejected]
    failed = [r for r in run.records if not r.ok and not r.rejected]
    wall = run.wall_s
    tokens = sum(r.output_tokens or 0 for r in ok)
    audio = sum(r.audio_seconds for r in ok)
    by_message: dict[str, int] = {}
    for r in failed:
        by_message[r.error or "unknown error"] = by_message.get(r.error or "unknown error", 0) + 1
    sources: dict[str, int] = {}
    for r in ok:
        sources[r.token_source or "unknown"] = sources.get(r.token_source or "unknown", 0) + 1
    return {
        "label": run.label, "system": run.system, "mode": run.mode, "concurrency": run.concurrency,
        "request_rate": run.request_rate, "streaming": run.streaming, "wall_s": wall,
        "client_buffer_s": run.client_buffer_s,
        "num_requests": len(run.records), "num_ok": len(ok), "num_errors": len(failed),
        "num_rejected": len(rejected), "rejections": sum(r.rejections for r in run.records),
        "waited_s": stats([r.waited_s for r in ok]) if any(r.rejections for r in ok) else None,
        "errors_by_message": by_message,
        "errors": [{"index": r.index, "status": r.status, "error": r.error} for r in failed[:20]],
        "output_tokens": tokens, "audio_seconds": audio,
        "token_sources": sources,
        "tokens_exact": all(s in EXACT_TOKEN_SOURCES for s in sources),
        "latency_s": {m: stats(v) for m, v in metric_values(run).items()},
        "playback": heard([r.audio_chunks for r in ok], run.client_buffer_s) if run.streaming else None,
        "throughput": {
            "requests_per_s": len(ok) / wall if wall > 0 else None,
            "output_tokens_per_s": tokens / wall if wall > 0 else None,
            "audio_s_per_s": audio / wall if wall > 0 and audio > 0 else None,
        },
        "notes": list(run.notes),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _texts(run: RunResult | None) -> dict[int, str]:
    return {r.index: r.text_sha1 for r in run.records if r.ok and r.text_sha1} if run is not None else {}


def compare(engine: dict[str, Any], baseline: dict[str, Any], engine_run: RunResult | None = None,
            baseline_run: RunResult | None = None) -> dict[str, Any]:
    """Ratios of two ``summarize`` dicts (engine / baseline); with the runs, also how many outputs are identical."""
    lat: dict[str, dict[str, float | None]] = {}
    for m in METRICS:
        e, b = engine["latency_s"].get(m), baseline["latency_s"].get(m)
        if e and b:
            lat[m] = {s: _ratio(e[s], b[s]) for s in ("mean", "p50", "p95", "p99")}
    out = {
        "engine": engine["label"], "baseline": baseline["label"],
        "throughput_ratio": {k: _ratio(engine["throughput"][k], baseline["throughput"][k]) for k in THROUGHPUTS
                             if engine["throughput"][k] and baseline["throughput"][k]},
        "latency_ratio": lat,
    }
    e_text, b_text = _texts(engine_run), _texts(baseline_run)
    common = sorted(set(e_text) & set(b_text))
    if common:
        out["identical_text"] = {"compared": len(common), "identical": sum(e_text[i] == b_text[i] for i in common)}
    return out


def _match(run: dict[str, Any], candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
    for c in candidates:
        if c["concurrency"] == run["concurrency"] and c["request_rate"] == run["request_rate"]:
            return c
    return candidates[0] if len(candidates) == 1 else None


def build_report(runs: list[RunResult], config: dict[str, Any] | None = None,
                 notes: list[str] | None = None) -> dict[str, Any]:
    summaries = [summarize(r) for r in runs]
    by_label = {r.label: r for r in runs}
    comparisons = []
    for s in summaries:
        if s["system"] not in ENGINE_SYSTEMS:
            continue
        for system in (VLLM_NATIVE.get(s["system"]), *BASELINE_SYSTEMS):
            base = _match(s, [b for b in summaries if b["system"] == system]) if system else None
            if base is not None:
                comparisons.append(compare(s, base, by_label.get(s["label"]), by_label.get(base["label"])))
    all_notes = list(notes or [])
    if comparisons:
        all_notes.append("ratios are engine / baseline: throughput_ratio > 1 and latency_ratio < 1 favour the engine")
    systems = {s["system"] for s in summaries}
    if any(v in systems and n in systems for v, n in VLLM_NATIVE.items()):
        all_notes.append("rows of a vLLM-thinker run (vllm, engine_vllm) against its native counterpart "
                         "(engine_text, engine) compare the two thinker backends: > 1 / < 1 favour vLLM")
    if any(not s["streaming"] for s in summaries):
        all_notes.append("non-streaming runs (" + ", ".join(s["label"] for s in summaries if not s["streaming"])
                         + "): TTFT and TTFP equal the E2E latency; they have no ITL")
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config or {},
        "notes": all_notes,
        "runs": summaries,
        "comparisons": comparisons,
        "records": {r.label: [rec.to_dict() for rec in r.records] for r in runs},
    }


def runs_of(report: dict[str, Any]) -> list[RunResult]:
    """The ``RunResult``s a report was built from (its summaries plus its per-request records)."""
    return [RunResult(label=s["label"], system=s["system"], mode=s["mode"], concurrency=s["concurrency"],
                      request_rate=s["request_rate"], wall_s=s["wall_s"], streaming=s["streaming"],
                      client_buffer_s=s.get("client_buffer_s", 0.5),
                      records=[RequestRecord.from_dict(r) for r in report["records"].get(s["label"], [])],
                      notes=list(s["notes"])) for s in report["runs"]]


def merge_reports(reports: list[dict[str, Any]]) -> tuple[dict[str, Any], list[RunResult]]:
    """One report of the runs of ``reports`` (same workload; run labels must be unique across them)."""
    if not reports:
        raise ValueError("no reports to merge")
    first = reports[0].get("config", {})
    for other in reports[1:]:
        cfg = other.get("config", {})
        diff = [k for k in WORKLOAD_KEYS if first.get(k) != cfg.get(k)]
        if diff:
            raise ValueError(f"reports of different workloads cannot be merged (they differ in {', '.join(diff)})")
    runs = [run for rep in reports for run in runs_of(rep)]
    labels = [r.label for r in runs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"run labels appear in more than one report: {', '.join(dup)}")
    derived = ("ratios are engine", "rows of a vLLM-thinker", "non-streaming runs (")  # build_report adds them
    notes = [n for rep in reports for n in rep.get("notes", []) if not n.startswith(derived)]
    config = {**first, "merged": [rep.get("config", {}) for rep in reports]}
    return build_report(runs, config=config, notes=list(dict.fromkeys(notes))), runs


# --------------------------------------------------------------------------- outputs


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *[line(r) for r in rows]])


def _rejections(summary: dict[str, Any]) -> str:
    """The run's 429s, with those that ended rejected (not admitted before the timeout) in brackets."""
    n, left = summary.get("rejections", 0), summary.get("num_rejected", 0)
    return f"{n} ({left} rejected)" if left else str(n)


def format_table(report: dict[str, Any]) -> str:
    runs = report["runs"]
    out = ["Throughput (successful requests over each run's wall time)"]
    out.append(_table(
        ["run", "requests", "errors", "429s", "wall s", "req/s", "out tok/s", "audio s/s", "token count"],
        [[s["label"], str(s["num_requests"]), str(s["num_errors"]), _rejections(s), _num(s["wall_s"]),
          _num(s["throughput"]["requests_per_s"], "{:.3f}"), _num(s["throughput"]["output_tokens_per_s"], "{:.1f}"),
          _num(s["throughput"]["audio_s_per_s"], "{:.3f}"),
          ",".join(s["token_sources"]) + ("" if s["tokens_exact"] else " (approx)")] for s in runs]))
    rows = []
    for s in runs:
        for m in METRICS:
            st = s["latency_s"].get(m)
            if not st:
                continue
            conv = _num if m == "rtf" else _ms
            rows.append([s["label"], m + (" (x)" if m == "rtf" else " (ms)"), str(st["n"]), conv(st["mean"]),
                         conv(st["p50"]), conv(st["p95"]), conv(st["p99"])])
    out += ["", "Latency (successful requests; RTF = E2E / audio seconds)",
            _table(["run", "metric", "n", "mean", "p50", "p95", "p99"], rows) if rows else "  (no successful requests)"]
    heard_table = [row for s in runs if (row := heard_rows(s["label"], s.get("playback")))]
    if heard_table:
        out += ["", "Playback (each stream's audio played by a client that starts buffer s after its first audio; a "
                "stall: a chunk that came after the buffer ran dry)", _table(HEARD_HEADER, heard_table)]
    if report["comparisons"]:
        crow = []
        for c in report["comparisons"]:
            t, lat = c["throughput_ratio"], c["latency_ratio"]
            crow.append([c["engine"], c["baseline"], _num(t.get("requests_per_s")), _num(t.get("output_tokens_per_s")),
                         _num(t.get("audio_s_per_s")), _num((lat.get("e2e") or {}).get("p50")),
                         _num((lat.get("ttft") or {}).get("p50")), _num((lat.get("ttfp") or {}).get("p50")),
                         _num((lat.get("rtf") or {}).get("p50")),
                         "{identical}/{compared}".format(**c["identical_text"]) if "identical_text" in c else "-"])
        out += ["", "Engine / baseline ratios (throughput x: >1 engine better; latency x: <1 engine better)",
                _table(["engine", "baseline", "req/s x", "tok/s x", "audio/s x", "E2E p50 x", "TTFT p50 x",
                        "TTFP p50 x", "RTF p50 x", "same text"], crow)]
    return "\n".join(out + table_tail(report))


def table_tail(report: dict[str, Any]) -> list[str]:
    """The lines every bench table ends with: its runs' errors by message, the report's and the runs' notes, and
    the machine it ran on."""
    runs = report["runs"]
    out = []
    errs = [(s["label"], msg, n) for s in runs for msg, n in s["errors_by_message"].items()]
    if errs:
        out += ["", "Errors"] + [f"  {label}: {n} x {msg}" for label, msg, n in errs]
    notes = report["notes"] + [f"{s['label']}: {n}" for s in runs for n in s["notes"]]
    if notes:
        out += ["", "Notes"] + [f"  - {n}" for n in notes]
    return out + machine_section(report["config"].get("machine"))


def _x_kind(runs: list[RunResult]) -> str:
    """The load axis: offered rate when every engine run is open-loop, else concurrency (open-loop runs then stay
    off the vs-load panels, and show in the per-run ones)."""
    engine = [r for r in runs if r.system in ENGINE_SYSTEMS] or runs
    return "rate" if all(r.request_rate is not None for r in engine) else "concurrency"


def _on_load_axis(run: RunResult, kind: str) -> bool:
    return kind == "rate" or run.request_rate is None


def plot_report(runs: list[RunResult], path: str) -> str:
    """Latency distributions per run and throughput vs load, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = {r.label: metric_values(r) for r in runs}
    labels = [r.label for r in runs]
    fig, axes = plt.subplots(3, 3, figsize=(18, 15))
    ax = axes[0][0]
    for label in labels:
        v = sorted(values[label]["e2e"])
        if v:
            ax.step(v, [(i + 1) / len(v) for i in range(len(v))], where="post", label=label)
    ax.set(title="E2E latency CDF", xlabel="seconds", ylabel="fraction of requests")
    ax.grid(alpha=0.3)
    if any(values[label]["e2e"] for label in labels):
        ax.legend(fontsize=7)
    for ax, metric, title in ((axes[0][1], "ttft", "TTFT (first text)"), (axes[0][2], "ttfp", "TTFP (first audio)"),
                              (axes[1][0], "itl", "ITL (between text deltas)")):
        data = [(label, values[label][metric]) for label in labels if values[label][metric]]
        if data:
            ax.boxplot([d for _, d in data], showfliers=True)
            ax.set_xticks(range(1, len(data) + 1), [lbl for lbl, _ in data], rotation=30, ha="right", fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=title, ylabel="seconds")
        ax.grid(alpha=0.3)

    kind = _x_kind(runs)
    xlabel = "offered load (requests/s)" if kind == "rate" else "concurrency (requests in flight)"
    any_audio = any(r.audio_seconds > 0 for run in runs for r in run.records)
    for ax, key, title in ((axes[1][1], "output_tokens_per_s", "output tokens/s"),
                           (axes[1][2], "audio_s_per_s" if any_audio else "requests_per_s",
                            "audio seconds per second" if any_audio else "requests/s")):
        systems: dict[str, list[RunResult]] = {}
        for r in runs:
            if _on_load_axis(r, kind):
                systems.setdefault(r.system, []).append(r)
        xs_all = []
        for system, group in systems.items():
            pts = []
            for r in group:
                x = r.request_rate if kind == "rate" else r.concurrency
                y = summarize(r)["throughput"][key]
                pts.append((x, y))
            if all(x is not None for x, _ in pts):
                pts.sort()
                xs_all += [x for x, _ in pts]
                ax.plot([x for x, _ in pts], [y or 0 for _, y in pts], marker="o", label=system)
            else:
                for _, y in pts:
                    ax.axhline(y or 0, linestyle="--", color="gray", label=f"{system} (sequential)")
        if xs_all and max(xs_all) / max(min(xs_all), 1e-9) >= 4:
            ax.set_xscale("log", base=2)
        if xs_all:
            ax.set_xticks(sorted(set(xs_all)), [f"{x:g}" for x in sorted(set(xs_all))])
            ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set(title=f"{title} vs load", xlabel=xlabel, ylabel=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _plot_heard(axes[2], runs, kind, xlabel)
    fig.suptitle("omni-serve bench")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot_heard(axes, runs: list[RunResult], kind: str, xlabel: str) -> None:
    """The listener's row: gaps between audio chunks, stalled streams, and TTFP p50/p95 vs load."""
    gaps = [(r.label, [b[0] - a[0] for rec in r.records if rec.ok for a, b in zip(rec.audio_chunks,
                                                                                    rec.audio_chunks[1:])])
            for r in runs]
    gaps = [(label, g) for label, g in gaps if g]
    ax = axes[0]
    if gaps:
        ax.boxplot([g for _, g in gaps], showfliers=True)
        ax.set_xticks(range(1, len(gaps) + 1), [lbl for lbl, _ in gaps], rotation=30, ha="right", fontsize=7)
    else:
        ax.text(0.5, 0.5, "no streamed audio", ha="center", va="center", transform=ax.transAxes)
    ax.set(title="gaps between audio chunks", ylabel="seconds")
    ax.grid(alpha=0.3)
    ax = axes[1]
    heard_runs = [(r.label, summarize(r)["playback"]) for r in runs]
    heard_runs = [(label, h) for label, h in heard_runs if h]
    if heard_runs:
        xs = range(len(heard_runs))
        ax.bar(xs, [h["streams"] for _, h in heard_runs], color="lightgray", label="streams")
        ax.bar(xs, [h["stalled_streams"] for _, h in heard_runs], color="tab:red", label="stalled")
        ax.set_xticks(list(xs), [lbl for lbl, _ in heard_runs], rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=8)
        buffers = sorted({h["client_buffer_s"] for _, h in heard_runs})
        ax.set_title(f"streams that stalled (client buffer {', '.join(f'{b:g}' for b in buffers)} s)")
    else:
        ax.text(0.5, 0.5, "no streamed audio", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("streams that stalled")
    ax.grid(alpha=0.3)
    ax = axes[2]
    plotted = False
    for system in dict.fromkeys(r.system for r in runs if r.system in ENGINE_SYSTEMS):
        pts = []
        for r in runs:
            ttfp = summarize(r)["latency_s"]["ttfp"] if r.system == system and _on_load_axis(r, kind) else None
            x = r.request_rate if kind == "rate" else r.concurrency
            if ttfp and x is not None:
                pts.append((x, ttfp["p50"], ttfp["p95"]))
        pts.sort()
        if pts:
            plotted = True
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{system} p50")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="x", linestyle="--", label=f"{system} p95")
    if plotted:
        ax.legend(fontsize=8)
    ax.set_ylim(bottom=0)
    ax.set(title="TTFP vs load", xlabel=xlabel, ylabel="seconds")
    ax.grid(alpha=0.3)


def write_report(report: dict[str, Any], runs: list[RunResult], out_dir: str,
                 name: str = "bench_report") -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    png_path = plot_report(runs, os.path.join(out_dir, f"{name}.png"))
    return json_path, png_path


def _load(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        path = os.path.join(path, "bench_report.json")
    with open(path) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    """``python -m omni_serve.bench.report merge OUT_DIR REPORT [REPORT ...]`` (a REPORT: a JSON file or its dir)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 3 or args[0] != "merge":
        print("usage: python -m omni_serve.bench.report merge OUT_DIR REPORT [REPORT ...]", file=sys.stderr)
        return 2
    report, runs = merge_reports([_load(p) for p in args[2:]])
    json_path, png_path = write_report(report, runs, args[1])
    print(format_table(report))
    print(f"\nwrote {json_path}\nwrote {png_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def plot_boxes_and_rate(runs, boxes: list[tuple[str, list[float]]], rate: dict[str, float], path: str, title: str,
                        box_title: str, rate_title: str, xlabel: str, ylabel: str) -> str:
    """A bench's PNG: ``boxes`` (label, seconds) as box plots on the left; on the right each engine run's ``rate``
    (by label) against its concurrency, each other run's as a dashed line (one request at a time). Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    fig.suptitle(title)
    boxes = [b for b in boxes if b[1]]
    if boxes:
        left.boxplot([v for _, v in boxes])
        left.set_xticks(range(1, len(boxes) + 1), [lbl for lbl, _ in boxes], rotation=20, ha="right", fontsize=8)
    left.set(title=box_title, ylabel="seconds")
    left.grid(alpha=0.3)
    engine = sorted((r.concurrency, rate[r.label]) for r in runs if r.system == "engine")
    if engine:
        right.plot([c for c, _ in engine], [y for _, y in engine], marker="o", label="engine")
        right.set_xticks([c for c, _ in engine], [str(c) for c, _ in engine])
    for r in runs:
        if r.system != "engine":
            right.axhline(rate[r.label], linestyle="--", color="gray", label=f"{r.label} (one at a time)")
    right.set_ylim(bottom=0)
    right.set(title=rate_title, xlabel=xlabel, ylabel=ylabel)
    right.grid(alpha=0.3)
    if runs:
        right.legend(fontsize=8)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
