"""``omni-serve bench --mode speech``: text-to-speech (``POST /v1/audio/speech``) against transformers.

Contract: ``run_speech_bench(cfg, baseline)`` sends ``cfg.num_requests`` texts (seeded, ``min_words``-``max_words``
words) to the running server at every ``concurrency`` (closed loop), streaming raw pcm (``response_format=pcm``,
greedy codec tokens: ``temperature=0``), and records per request TTFP (first audio byte), E2E and the audio's
seconds. Then, the server stopped first when ``stop_server_pid`` is given (the baseline gets a quiet machine),
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
    voice: str | None = Field(None, description="Voice; default: the family's (Chelsie / Ethan).")
    num_requests: int = Field(16, ge=1, description="Texts per load point.")
    concurrency: list[int] = Field(default_factory=lambda: [1, 8], description="Closed-loop points.")
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
    threads: int | None = Field(None, ge=1, description="torch threads of the baseline (default: all cores).")
    stop_server_pid: int | None = Field(None, description="Stop this server process before the baseline runs.")
    out: str = Field("bench_speech", description="Report directory.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")

    def texts(self) -> list[str]:
        rng = random.Random(self.seed)
        return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(self.min_words, self.max_words)))
                for _ in range(self.num_requests)]

    def default_voice(self) -> str:
        return self.voice or ("Chelsie" if self.graph == "qwen2_5_omni" else "Ethan")


@dataclass
class SpeechRecord:
    ok: bool
    ttfp_s: float | None = None
    e2e_s: float = 0.0
    audio_s: float = 0.0
    error: str | None = None


@dataclass
class SpeechPoint:
    system: str
    concurrency: int
    wall_s: float
    records: list[SpeechRecord] = field(default_factory=list)

    def summary(self) -> dict:
        ok = [r for r in self.records if r.ok]
        audio = sum(r.audio_s for r in ok)
        ttfp = [r.ttfp_s for r in ok if r.ttfp_s is not None]
        e2e = [r.e2e_s for r in ok]
        return {"system": self.system, "concurrency": self.concurrency, "requests": len(self.records),
                "failed": len(self.records) - len(ok), "wall_s": round(self.wall_s, 3),
                "audio_s": round(audio, 3), "audio_s_per_s": round(audio / self.wall_s, 4) if self.wall_s else 0.0,
                "rtf_mean": round(statistics.mean(r.e2e_s / r.audio_s for r in ok if r.audio_s), 4) if audio else None,
                "ttfp_p50_s": _pct(ttfp, 50), "ttfp_p95_s": _pct(ttfp, 95), "e2e_p50_s": _pct(e2e, 50),
                "e2e_p95_s": _pct(e2e, 95), "e2e_mean_s": round(statistics.mean(e2e), 4) if e2e else None,
                "ttfp_over_e2e": round(statistics.mean(t / e for t, e in zip(ttfp, e2e)), 4) if ttfp else None}


def _pct(values: list[float], q: int) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))], 4)


# -- the engine: HTTP --------------------------------------------------------------------------------------
async def _speak(client, url: str, body: dict, timeout_s: float) -> SpeechRecord:
    t0 = time.perf_counter()
    ttfp, n = None, 0
    try:
        async with client.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=timeout_s) as r:
            if r.status_code != 200:
                return SpeechRecord(ok=False, e2e_s=time.perf_counter() - t0,
                                    error=f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for chunk in r.aiter_raw():
                if chunk and ttfp is None:
                    ttfp = time.perf_counter() - t0
                n += len(chunk)
    except Exception as exc:  # noqa: BLE001 - a failed request is a record, not a crash
        return SpeechRecord(ok=False, e2e_s=time.perf_counter() - t0, error=repr(exc))
    return SpeechRecord(ok=n > 0, ttfp_s=ttfp, e2e_s=time.perf_counter() - t0, audio_s=n / 2 / SAMPLE_RATE,
                        error=None if n else "no audio")


async def _closed_loop(cfg: SpeechBenchConfig, model: str, texts: list[str], concurrency: int) -> SpeechPoint:
    import httpx

    queue = list(enumerate(texts))
    records: list[SpeechRecord | None] = [None] * len(texts)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker():
            while queue:
                i, text = queue.pop(0)
                body = {"model": model, "input": text, "voice": cfg.default_voice(), "response_format": "pcm",
                        "temperature": 0, "seed": cfg.seed + i}
                records[i] = await _speak(client, cfg.url.rstrip("/"), body, cfg.timeout_s)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return SpeechPoint("engine", concurrency, wall, records)


def run_engine(cfg: SpeechBenchConfig, texts: list[str]) -> list[SpeechPoint]:
    from omni_serve.bench.client import discover_model

    model = cfg.model or asyncio.run(discover_model(cfg.url)) or "qwen2.5-omni"
    if cfg.warmup:
        asyncio.run(_closed_loop(cfg, model, texts[:cfg.warmup], 1))
    points = []
    for c in cfg.concurrency:
        point = asyncio.run(_closed_loop(cfg, model, texts, c))
        log.info("engine c=%d: %s", c, point.summary())
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
        report["ratios"] = {f"engine_c{p.concurrency}_over_hf_audio_s_per_s":
                            round(p.summary()["audio_s_per_s"] / base, 3) for p in points}
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "speech_bench_report.json"), "w") as f:
        json.dump(report | {"records": {f"{p.system}_c{p.concurrency}": [asdict(r) for r in p.records]
                                        for p in points + ([baseline] if baseline else [])}}, f, indent=1)
    return report


def format_report(report: dict) -> str:
    cols = ("system", "concurrency", "requests", "failed", "audio_s", "wall_s", "audio_s_per_s", "rtf_mean",
            "ttfp_p50_s", "e2e_p50_s", "ttfp_over_e2e")
    lines = [" | ".join(cols)]
    lines += [" | ".join(str(row.get(c)) for c in cols) for row in report["points"]]
    lines += [f"{k}: {v}" for k, v in report["ratios"].items()]
    lines += [f"calibration before the {k} runs: {v * 1000:.1f} ms" for k, v in report.get("calibration_s", {}).items()]
    lines += [f"note: {n}" for n in report.get("notes", [])]
    lines += machine_section(report.get("machine"))
    return "\n".join(lines)
