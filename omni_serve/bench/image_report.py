"""Report of ``omni-serve bench --mode image``: per-run summaries, engine/baseline ratios, pixel parity, cache
quality (PSNR), and the JSON / PNG / stdout outputs.

Contract:

* ``summarize_image_run(run)``: ``omni_serve.bench.report.summarize``'s counts and error listing (failed
  requests counted, never dropped) with image throughput over the run's wall time (``images_per_s``,
  ``requests_per_s``; successful requests only), E2E latency ``stats`` in seconds (successful requests),
  and per-image computed / cached step stats.
* ``comparisons``: every uncached engine run vs the ``diffusers`` run: ``images_per_s`` and
  ``requests_per_s`` ratios engine / baseline (> 1: the engine serves more) and E2E ratios (< 1: faster).
* ``parity``: the uncached engine run at the first concurrency vs the baseline, per request the max abs
  difference of uint8 pixels over its images (same shapes only); ``ok`` when every compared request is
  within ``PARITY_TOLERANCE`` levels.
* ``cache``: per cached run, images/s, speedup over the uncached run at the same concurrency, cached steps
  per image, and ``psnr(cached, uncached)`` per request against the uncached run at the same concurrency
  (else the first uncached run): mean, min, mean over the non-identical requests, identical count.
  PSNR of identical images is infinite: in the JSON every non-finite number is written as ``null``.
* ``write_image_report`` writes ``image_bench_report.json`` and ``image_bench_report.png`` (matplotlib, Agg:
  E2E box plots per run; images/s vs concurrency, baseline as a horizontal line, cache runs as markers).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from omni_serve.bench.report import _ms, _num, _ratio, _table, stats, summarize, table_tail

PARITY_TOLERANCE = 2  # uint8 levels
SUMMARY_KEYS = ("label", "system", "concurrency", "wall_s", "num_requests", "num_ok", "num_errors", "num_rejected",
                "rejections", "errors_by_message", "errors", "notes")


def psnr(a, b) -> float:
    """PSNR in dB of two uint8 images (or stacks) of equal shape; ``inf`` when identical."""
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(255.0 ** 2 / mse)


def max_abs_diff(a, b) -> int:
    import numpy as np

    return int(np.max(np.abs(np.asarray(a, dtype=np.int16) - np.asarray(b, dtype=np.int16))))


def _pairs(run_a, run_b):
    """(index, images of a, images of b) for requests ok in both with equally shaped images."""
    b_ok = {r.index: r for r in run_b.records if r.ok}
    for r in run_a.records:
        o = b_ok.get(r.index)
        if r.ok and o is not None and [i.shape for i in r.images] == [i.shape for i in o.images] and r.images:
            yield r.index, r.images, o.images


def summarize_image_run(run) -> dict[str, Any]:
    s = summarize(run)
    ok = [r for r in run.records if r.ok]
    images = sum(r.num_images for r in ok)
    out = {k: s[k] for k in SUMMARY_KEYS}
    out.update(mode="image", cache_mode=run.cache_mode, num_images=images, latency_s={"e2e": s["latency_s"]["e2e"]},
               throughput={"images_per_s": images / run.wall_s if run.wall_s > 0 else None,
                           "requests_per_s": s["throughput"]["requests_per_s"]},
               computed_steps_per_image=stats([c for r in ok for c in r.computed_steps]),
               cached_steps_per_image=stats([c for r in ok for c in r.cached_steps]))
    return out


def compare_image(engine: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    e, b = engine["latency_s"]["e2e"], baseline["latency_s"]["e2e"]
    return {"engine": engine["label"], "baseline": baseline["label"], "concurrency": engine["concurrency"],
            "throughput_ratio": {k: _ratio(engine["throughput"][k], baseline["throughput"][k])
                                 for k in ("images_per_s", "requests_per_s")},
            "e2e_ratio": {s: _ratio(e[s], b[s]) for s in ("mean", "p50", "p95", "p99")} if e and b else {}}


def parity(engine_run, baseline_run, tolerance: int = PARITY_TOLERANCE) -> dict[str, Any]:
    diffs = {i: max(max_abs_diff(x, y) for x, y in zip(a, b)) for i, a, b in _pairs(engine_run, baseline_run)}
    vals = list(diffs.values())
    return {"engine": engine_run.label, "baseline": baseline_run.label, "compared": len(vals),
            "max_abs_diff": max(vals) if vals else None,
            "mean_max_abs_diff": sum(vals) / len(vals) if vals else None,
            "tolerance": tolerance, "within_tolerance": sum(v <= tolerance for v in vals),
            "ok": bool(vals) and max(vals) <= tolerance, "per_request": diffs}


def cache_quality(cached_run, reference_run, summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    values = {i: psnr(a, b) for i, a, b in _pairs(cached_run, reference_run)}
    finite = [v for v in values.values() if math.isfinite(v)]
    s, ref = summaries[cached_run.label], summaries[reference_run.label]
    cached = s["cached_steps_per_image"]
    steps = s["computed_steps_per_image"]
    per_image = (cached["mean"] + steps["mean"]) if cached and steps else None
    same_c = ref["concurrency"] == s["concurrency"]
    return {"label": cached_run.label, "mode": cached_run.cache_mode, "concurrency": cached_run.concurrency,
            "reference": reference_run.label, "images_per_s": s["throughput"]["images_per_s"],
            "speedup_vs_uncached": _ratio(s["throughput"]["images_per_s"], ref["throughput"]["images_per_s"])
            if same_c else None,
            "cached_steps_per_image": cached["mean"] if cached else None,
            "cached_fraction": cached["mean"] / per_image if cached and per_image else None,
            "psnr_db": {"compared": len(values),
                        "mean": sum(values.values()) / len(values) if values else None,
                        "min": min(values.values()) if values else None,
                        "mean_finite": sum(finite) / len(finite) if finite else None,
                        "identical": len(values) - len(finite), "per_request": values}}


def build_image_report(runs: list, config: dict[str, Any] | None = None,
                       notes: list[str] | None = None) -> dict[str, Any]:
    summaries = {r.label: summarize_image_run(r) for r in runs}
    uncached = [r for r in runs if r.system == "engine" and r.cache_mode == "off"]
    base = next((r for r in runs if r.system == "diffusers"), None)
    all_notes = list(notes or [])
    comparisons, par = [], None
    if base is not None:
        comparisons = [compare_image(summaries[r.label], summaries[base.label]) for r in uncached]
        if uncached:
            par = parity(uncached[0], base)
        all_notes.append("ratios are engine / baseline: images/s x > 1 and E2E x < 1 favour the engine")
        all_notes.append(f"parity: max abs uint8 pixel difference per request, {uncached[0].label if uncached else '-'}"
                         f" vs {base.label}; ok when <= {PARITY_TOLERANCE}")
    cache = []
    for r in runs:
        if r.system == "engine" and r.cache_mode != "off" and uncached:
            ref = next((u for u in uncached if u.concurrency == r.concurrency), uncached[0])
            cache.append(cache_quality(r, ref, summaries))
    if cache:
        all_notes.append("cache PSNR (dB): each cached image vs the uncached engine image of the same request "
                         "(same seed); identical images have infinite PSNR, written as null in the JSON")
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config or {}, "notes": all_notes,
            "runs": list(summaries.values()), "comparisons": comparisons, "parity": par, "cache": cache,
            "records": {r.label: [rec.to_dict() for rec in r.records] for r in runs}}


# --------------------------------------------------------------------------- outputs


def _db(v: float | None) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.1f}")


def format_image_table(report: dict[str, Any]) -> str:
    rows = []
    for s in report["runs"]:
        e2e = s["latency_s"]["e2e"] or {}
        cached = s["cached_steps_per_image"]
        rows.append([s["label"], str(s["num_requests"]), str(s["num_errors"]), str(s.get("num_rejected", 0)),
                     _num(s["wall_s"]),
                     _num(s["throughput"]["images_per_s"], "{:.3f}"), _num(s["throughput"]["requests_per_s"], "{:.3f}"),
                     *(_ms(e2e.get(k)) for k in ("p50", "p95", "p99", "mean")),
                     _num(cached["mean"] if cached else None, "{:.1f}")])
    out = ["Runs (successful requests over each run's wall time; E2E in ms)",
           _table(["run", "requests", "errors", "429s", "wall s", "images/s", "req/s", "E2E p50", "p95", "p99", "mean",
                   "cached steps/img"], rows)]
    if report["comparisons"]:
        out += ["", "Engine / baseline ratios (images/s x: >1 engine better; E2E x: <1 engine better)",
                _table(["engine", "baseline", "images/s x", "req/s x", "E2E p50 x", "E2E mean x"],
                       [[c["engine"], c["baseline"], _num(c["throughput_ratio"]["images_per_s"]),
                         _num(c["throughput_ratio"]["requests_per_s"]), _num(c["e2e_ratio"].get("p50")),
                         _num(c["e2e_ratio"].get("mean"))] for c in report["comparisons"]])]
    p = report["parity"]
    if p:
        out += ["", f"Parity {p['engine']} vs {p['baseline']}: {p['compared']} requests compared, max abs pixel "
                    f"diff {_num(p['max_abs_diff'], '{}')} (mean {_num(p['mean_max_abs_diff'])}), "
                    f"{p['within_tolerance']}/{p['compared']} within {p['tolerance']} -> "
                    + ("OK" if p["ok"] else "MISMATCH")]
    if report["cache"]:
        out += ["", "Cache runs (PSNR vs the uncached engine image of the same request)",
                _table(["run", "reference", "images/s", "speedup", "cached steps/img", "cached %", "PSNR mean dB",
                        "min dB", "identical"],
                       [[c["label"], c["reference"], _num(c["images_per_s"], "{:.3f}"), _num(c["speedup_vs_uncached"]),
                         _num(c["cached_steps_per_image"], "{:.1f}"),
                         _num(None if c["cached_fraction"] is None else 100 * c["cached_fraction"], "{:.0f}"),
                         _db(c["psnr_db"]["mean"]), _db(c["psnr_db"]["min"]),
                         f"{c['psnr_db']['identical']}/{c['psnr_db']['compared']}"] for c in report["cache"]])]
    return "\n".join(out + table_tail(report))


def plot_image_report(runs: list, report: dict[str, Any], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), layout="constrained")
    fig.suptitle("omni-serve bench --mode image")
    data = [(r.label, [x.e2e_s for x in r.records if x.ok and x.e2e_s is not None]) for r in runs]
    data = [d for d in data if d[1]]
    if data:
        left.boxplot([v for _, v in data], showfliers=True)
        left.set_xticks(range(1, len(data) + 1), [lbl for lbl, _ in data], rotation=25, ha="right", fontsize=8)
    else:
        left.text(0.5, 0.5, "no successful requests", ha="center", va="center", transform=left.transAxes)
    left.set(title="E2E latency per request", ylabel="seconds")
    left.grid(alpha=0.3)
    summaries = {s["label"]: s for s in report["runs"]}
    ips = {r.label: summaries[r.label]["throughput"]["images_per_s"] or 0 for r in runs}
    engine = sorted((r.concurrency, ips[r.label]) for r in runs if r.system == "engine" and r.cache_mode == "off")
    if engine:
        right.plot([c for c, _ in engine], [y for _, y in engine], marker="o", label="engine (no cache)")
    for r, marker in zip([r for r in runs if r.system == "engine" and r.cache_mode != "off"], "s^Dvp*"):
        right.scatter([r.concurrency], [ips[r.label]], marker=marker, s=70, zorder=3, label=f"engine {r.cache_mode}")
    for r in runs:
        if r.system != "engine":
            right.axhline(ips[r.label], linestyle="--", color="gray", label=f"{r.label} (sequential)")
    xs = sorted({r.concurrency for r in runs if r.system == "engine"})
    if xs:
        right.set_xticks(xs, [str(x) for x in xs])
    right.set_ylim(bottom=0)
    right.set(title="images/s vs concurrency", xlabel="concurrency (requests in flight)", ylabel="images/s")
    right.grid(alpha=0.3)
    if runs:
        right.legend(fontsize=8)
    try:
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (e.g. the PSNR of identical images) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_image_report(report: dict[str, Any], runs: list, out_dir: str,
                       name: str = "image_bench_report") -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(json_safe(report), f, indent=2, default=str, allow_nan=False)
    return json_path, plot_image_report(runs, report, os.path.join(out_dir, f"{name}.png"))
