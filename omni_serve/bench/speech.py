"""``omni-serve bench --mode speech``: text-to-speech (``POST /v1/audio/speech``) against transformers.

Contract: ``run_speech_bench(cfg, baseline)`` sends ``cfg.num_requests`` texts (seeded, ``min_words``-``max_words``
words) to the running server at every ``concurrency`` (closed loop) and every ``request_rate`` (open loop: Poisson
arrivals, in flight capped by the largest ``concurrency``), streaming raw pcm (``response_format=pcm``, greedy codec
tokens: ``temperature=0``), and records per request TTFP (first audio byte), E2E, the audio's seconds and each
piece's arrival, which ``omni_serve.bench.heard`` plays back with a ``client_buffer_s`` client (stalls, gaps between
chunks, headroom, RTF after the first chunk). A 429 (the server at capacity) is sent again after its
``Retry-After`` with ``retry_rejected`` (the record counts the 429s and the wait; TTFP and E2E count from the
admitted try), and is otherwise a *rejected* request, counted apart from failures. Then, the server stopped first when ``stop_server_pid`` is given (the baseline gets a quiet machine),
the ``hf`` baseline (``baseline(cfg, texts) -> SpeechPoint``, the family's bench plug-in's, e.g.
``benchmarks.qwen2_5_omni.speech_baseline``) speaks the same texts one at a time in process. Reported per
system and point: audio seconds per second of wall time, RTF (E2E / audio seconds), TTFP and E2E percentiles,
TTFP / E2E at concurrency 1, and engine / baseline ratios. Writes ``speech_bench_report.json`` to ``out``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from omni_serve.bench.heard import HEARD_HEADER, heard, heard_rows
from omni_serve.bench.machine import machine_info, machine_section

log = logging.getLogger(__name__)
SAMPLE_RATE = 24000
WORDS = ("hello world cat dog morning evening river mountain music garden window coffee light story city ocean "
         "friend voice quiet bright yellow green winter summer travel people number simple answer question").split()


class SpeechBenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the running server.")
    graph: str = Field("qwen2_5_omni", description="The served family (its bench plug-in gives the hf baseline).")
    checkpoint: str | None = Field(None, description="The served checkpoint (the baseline loads it).")
    model: str | None = Field(None, description="Model name in requests; default: the first of /v1/models.")
    voice: str | None = Field(None, description="Voice; default: the family's (Chelsie / Ethan / alice).")
    num_requests: int = Field(16, ge=1, description="Texts per load point.")
    concurrency: list[int] = Field(default_factory=lambda: [1, 8], description=(
        "Closed-loop points; with request_rate, the largest caps requests in flight."))
    request_rate: list[float] | None = Field(None, description=(
        "Open-loop points: Poisson arrivals per second (seeded by seed), one run each, after the closed-loop ones."))
    client_buffer_s: float = Field(0.5, ge=0, description=(
        "Seconds a listening client buffers before it plays: the stalls and headroom reported assume it."))
    retry_rejected: bool = Field(True, description=(
        "Send a text again after its 429's Retry-After (as a client would) until admitted or timeout_s has passed; "
        "the report counts the 429s and the waits."))
    min_words: int = Field(12, ge=1, description="Shortest text, in words.")
    max_words: int = Field(24, ge=1, description="Longest text, in words.")
    seed: int = Field(0, description="Seed of the texts.")
    warmup: int = Field(2, ge=0, description="Requests sent before measuring.")
    calibrate: bool = Field(True, description=(
        "With the baseline: time a fixed CPU workload before the engine runs and before the baseline "
        "(omni_serve.bench.calibration); the report records both and notes drift above 10%."))
    baseline: Literal["hf", "none"] = Field("hf", description="hf: transformers one request at a time.")
    baseline_requests: int | None = Field(None, ge=1, description="Texts the baseline speaks (default: all).")
    max_codec_tokens: int = Field(1024, ge=1, description="The talker's limit (the served graph's, for the baseline).")
    num_steps: int = Field(10, ge=1, description="Qwen2.5-Omni token2wav steps (the served graph's).")
    max_speech_seconds: float | None = Field(None, gt=0, description=(
        "VibeVoice: the served graph's max_speech_seconds (the baseline's max_new_tokens: 7.5 a second)."))
    threads: int | None = Field(None, ge=1, description="torch threads of the baseline (default: all cores).")
    stop_server_pid: int | None = Field(None, description="Stop this server process before the baseline runs.")
    out: str = Field("bench_speech", description="Report directory.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")

    def texts(self) -> list[str]:
        rng = random.Random(self.seed)
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(self.min_words, self.max_words)))
                for _ in range(self.num_requests)]

    def default_voice(self) -> str:
        return self.voice or {"qwen2_5_omni": "Chelsie", "vibevoice": "alice"}.get(self.graph, "Ethan")


@dataclass
class SpeechRecord:
    ok: bool
    ttfp_s: float | None = None
    e2e_s: float = 0.0
    audio_s: float = 0.0
    error: str | None = None
    status: int | None = None  # HTTP status, when one came back
    audio_chunks: list[list[float]] = field(default_factory=list)  # [arrival from the request's start, seconds]
    retry_after_s: float = 0.0  # a 429's Retry-After
    rejections: int = 0  # 429s this text got (retried after each, with retry_rejected)
    waited_s: float = 0.0  # from the first try to the start of the last (ttfp_s and e2e_s count from there)

    @property
    def rejected(self) -> bool:
        """The server said it is at capacity (429): not served, not a failure."""
        return self.status == 429


@dataclass
class SpeechPoint:
    system: str
    concurrency: int
    wall_s: float
    records: list[SpeechRecord] = field(default_factory=list)
    request_rate: float | None = None  # open loop: Poisson arrivals per second
    client_buffer_s: float = 0.5

    @property
    def label(self) -> str:
        return f"{self.system}_c{self.concurrency}" + (f"_r{self.request_rate:g}" if self.request_rate else "")

    def summary(self) -> dict:
        ok = [r for r in self.records if r.ok]
        audio = sum(r.audio_s for r in ok)
        ttfp = [r.ttfp_s for r in ok if r.ttfp_s is not None]
        e2e = [r.e2e_s for r in ok]
        rejected = sum(r.rejected for r in self.records)
        listened = heard([r.audio_chunks for r in ok], self.client_buffer_s)
        return {"system": self.system, "concurrency": self.concurrency, "request_rate": self.request_rate,
                "requests": len(self.records), "rejected": rejected,
                "failed": len(self.records) - len(ok) - rejected, "wall_s": round(self.wall_s, 3),
                "ttfp_p99_s": _pct(ttfp, 99), "playback": listened,
                "rejections": sum(r.rejections for r in self.records),
                "waited_p95_s": _pct([r.waited_s for r in ok], 95),
                "first_audio_after_waiting_p95_s": _pct([r.waited_s + r.ttfp_s for r in ok if r.ttfp_s is not None],
                                                        95),
                "stalled_streams": listened["stalled_streams"] if listened else None,
                "audio_s": round(audio, 3), "audio_s_per_s": round(audio / self.wall_s, 4) if self.wall_s else 0.0,
                "rtf_mean": round(statistics.mean(r.e2e_s / r.audio_s for r in ok if r.audio_s), 4) if audio else None,
                "rtf_p50": _pct([r.e2e_s / r.audio_s for r in ok if r.audio_s], 50),
                "ttfp_p50_s": _pct(ttfp, 50), "ttfp_p95_s": _pct(ttfp, 95), "e2e_p50_s": _pct(e2e, 50),
                "e2e_p95_s": _pct(e2e, 95), "e2e_mean_s": round(statistics.mean(e2e), 4) if e2e else None,
                "ttfp_over_e2e": round(statistics.mean(t / e for t, e in zip(ttfp, e2e)), 4) if ttfp else None}


def plot_speech(points: list[SpeechPoint], path: str) -> str:
    """TTFP p50/p95/p99 and audio seconds per second vs load, and the streams that stalled, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(p.label, p.summary()) for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    xs = range(len(rows))
    names = [label for label, _ in rows]
    for key, marker in (("ttfp_p50_s", "o"), ("ttfp_p95_s", "x"), ("ttfp_p99_s", "^")):
        axes[0].plot(xs, [row[key] or 0 for _, row in rows], marker=marker, label=key[:-2])
    axes[0].set(title="time to first audio", ylabel="seconds")
    axes[1].bar(xs, [row["audio_s_per_s"] for _, row in rows])
    axes[1].set(title="audio seconds per second", ylabel="audio s / s")
    axes[2].bar(xs, [row["requests"] for _, row in rows], color="lightgray", label="requests")
    axes[2].bar(xs, [row["stalled_streams"] or 0 for _, row in rows], color="tab:red", label="stalled streams")
    axes[2].bar(xs, [row["rejected"] for _, row in rows], bottom=[row["stalled_streams"] or 0 for _, row in rows],
                color="tab:orange", label="rejected (429)")
    buffer = points[0].client_buffer_s if points else 0.5
    axes[2].set(title=f"streams that stalled (client buffer {buffer:g} s)", ylabel="requests")
    for ax in axes:
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=7)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 4)


# -- the engine: HTTP --------------------------------------------------------------------------------------
async def _speak(client, url: str, body: dict, timeout_s: float) -> SpeechRecord:
    from omni_serve.bench.client import retry_after

    t0 = time.perf_counter()
    ttfp, n, chunks = None, 0, []
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return SpeechRecord(ok=False, e2e_s=time.perf_counter() - t0, status=r.status_code,
                                    error=f"{r.status_code}: {(await r.aread())[:200]!r}",
                                    retry_after_s=retry_after(r.headers.get("retry-after")))
            async for chunk in r.aiter_raw():
                t = time.perf_counter() - t0
                if chunk and ttfp is None:
                    ttfp = t
                if chunk:
                    chunks.append([t, len(chunk) / 2 / SAMPLE_RATE])
                n += len(chunk)
    except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crash
        return SpeechRecord(ok=False, e2e_s=time.perf_counter() - t0, error=repr(exc))
    return SpeechRecord(ok=n > 0, ttfp_s=ttfp, e2e_s=time.perf_counter() - t0, audio_s=n / 2 / SAMPLE_RATE,
                        error=None if n else "no audio", status=200, audio_chunks=chunks)


async def _speak_until_admitted(client, cfg: "SpeechBenchConfig", body: dict) -> SpeechRecord:
    """``_speak``, and with ``retry_rejected`` again after each 429's ``Retry-After`` (``client.until_admitted``)."""
    from omni_serve.bench.client import until_admitted

    return await until_admitted(lambda: _speak(client, cfg.url.rstrip("/"), body, cfg.timeout_s), cfg.timeout_s,
                                cfg.retry_rejected)


async def _load_point(cfg: SpeechBenchConfig, model: str, texts: list[str], concurrency: int,
                      request_rate: float | None = None) -> SpeechPoint:
    """One point: ``concurrency`` requests kept in flight, or (``request_rate``) Poisson arrivals capped by it."""
    import httpx

    from omni_serve.bench.client import poisson_arrivals

    records: list[SpeechRecord | None] = [None] * len(texts)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def one(i: int, text: str) -> None:
            body = {"model": model, "input": text, "voice": cfg.default_voice(), "response_format": "pcm",
                    "temperature": 0, "seed": cfg.seed + i}
            records[i] = await _speak_until_admitted(client, cfg, body)

        t0 = time.perf_counter()
        if request_rate is None:
            queue = list(enumerate(texts))

            async def worker():
                while queue:
                    await one(*queue.pop(0))
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            cap = asyncio.Semaphore(concurrency)

            async def arrive(i: int, text: str, at: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
                async with cap:
                    await one(i, text)
            arrivals = poisson_arrivals(len(texts), request_rate, cfg.seed)
            await asyncio.gather(*(arrive(i, text, at) for (i, text), at in zip(enumerate(texts), arrivals)))
        wall = time.perf_counter() - t0
    return SpeechPoint("engine", concurrency, wall, records, request_rate, cfg.client_buffer_s)


def run_engine(cfg: SpeechBenchConfig, texts: list[str]) -> list[SpeechPoint]:
    from omni_serve.bench.client import discover_model

    model = cfg.model or asyncio.run(discover_model(cfg.url)) or "qwen2.5-omni"
    if cfg.warmup:
        asyncio.run(_load_point(cfg, model, texts[:cfg.warmup], 1))
    points = []
    plan = [(c, None) for c in cfg.concurrency] + [(max(cfg.concurrency), r) for r in cfg.request_rate or ()]
    for c, rate in plan:
        point = asyncio.run(_load_point(cfg, model, texts, c, rate))
        log.info("engine %s: %s", point.label, point.summary())
        points.append(point)
    return points


def run_speech_bench(cfg: SpeechBenchConfig,
                     baseline: Callable[[SpeechBenchConfig, list[str]], SpeechPoint] | None = None) -> dict:
    from omni_serve.bench.calibration import calibrate, drift_note

    texts = cfg.texts()
    machine = machine_info(cfg.url)
    calibration = {"engine": round(calibrate(), 5)} if cfg.calibrate and cfg.baseline == "hf" else {}
    points = run_engine(cfg, texts)
    if cfg.stop_server_pid is not None:
        from omni_serve.bench.server import stop_server

        stop_server(cfg.stop_server_pid)
    notes = []
    if calibration:
        calibration["baseline"] = round(calibrate(), 5)
        note = drift_note(calibration["engine"], calibration["baseline"])
        if note:
            log.warning(note)
            notes.append(note)
    if cfg.baseline == "hf" and baseline is None:
        raise ValueError(f"the {cfg.graph} bench gave no hf speech baseline")
    baseline = baseline(cfg, texts) if cfg.baseline == "hf" else None
    rows = [p.summary() for p in points] + ([baseline.summary()] if baseline else [])
    report = {"config": cfg.model_dump(), "points": rows, "ratios": {}, "calibration_s": calibration,
              "notes": notes, "machine": machine}
    if baseline is not None:
        base = baseline.summary()["audio_s_per_s"]
        report["ratios"] = {f"{p.label}_over_hf_audio_s_per_s": round(p.summary()["audio_s_per_s"] / base, 3)
                            for p in points}
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "speech_bench_report.json"), "w") as f:
        json.dump(report | {"records": {p.label: [asdict(r) for r in p.records]
                                        for p in points + ([baseline] if baseline else [])}}, f, indent=1)
    report["plot"] = plot_speech(points, os.path.join(cfg.out, "speech_bench_report.png"))
    return report


def format_report(report: dict) -> str:
    cols = ("system", "concurrency", "request_rate", "requests", "rejected", "rejections", "failed", "audio_s",
            "wall_s", "audio_s_per_s", "rtf_mean", "rtf_p50", "ttfp_p50_s", "ttfp_p95_s", "ttfp_p99_s",
            "waited_p95_s", "first_audio_after_waiting_p95_s", "e2e_p50_s", "ttfp_over_e2e")
    lines = [" | ".join(cols)]
    lines += [" | ".join(str(row.get(c)) for c in cols) for row in report["points"]]
    heard_table = [row for p in report["points"]
                   if (row := heard_rows(f"{p['system']} c={p['concurrency']}"
                                         + (f" rate={p['request_rate']:g}/s" if p.get("request_rate") else ""),
                                         p.get("playback")))]
    if heard_table:
        lines += ["", "playback (a client that starts buffer s after its first audio; a stall: a chunk that came "
                  "after the buffer ran dry)", " | ".join(HEARD_HEADER)]
        lines += [" | ".join(row) for row in heard_table]
    lines += [f"{k}: {v}" for k, v in report["ratios"].items()]
    lines += [f"calibration before the {k} runs: {v * 1000:.1f} ms" for k, v in report.get("calibration_s", {}).items()]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    lines += machine_section(report.get("machine"))
    return "\n".join(lines)
