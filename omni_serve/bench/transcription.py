"""``omni-serve bench --mode transcription``: OpenAI's ``POST /v1/audio/transcriptions`` against a running endpoint
vs the family's transformers model in process (``generate``, one request at a time).

Contract: ``run_transcription_bench(TranscriptionBenchConfig, baseline) -> BenchOutcome`` (the runner's: report
dict, JSON path, PNG path, printable table, runs).

* Workload (``build_transcription_workload``): a pure function of the config. ``num_requests`` clips of
  ``audio_seconds`` each, request ``i`` synthesized from seed ``seed + i`` (``synth_clip``: two tones and a little
  noise, gated by a slow sine so the clip has quiet gaps, as speech has; a different pitch per seed), 16 kHz mono,
  uploaded as a 16-bit WAV; every request asks for the config's ``language`` (forced: the model's prefix is
  prefilled, so its text streams from the first token; ``None`` lets the model name it, and its text then only
  starts after that prefix) and ``prompt``.
* Engine runs (``run_transcription_load``): per ``concurrency`` value, a closed loop keeping C uploads in flight
  (``httpx.AsyncClient``, multipart: ``file``, ``model``, ``language``, ``prompt``, ``stream=true``). Per request
  (``TranscriptionRecord``): ok or the error (HTTP status + OpenAI error message, an ``error`` event in the stream,
  a stream without ``transcript.text.done``, transport error, timeout; failures are counted, never dropped; a 429
  is *rejected*, counted apart and not sent again), TTFT (request sent -> the first non-empty
  ``transcript.text.delta``), the gaps between deltas, E2E (-> ``transcript.text.done``), the transcript (the done
  event's text) and its output tokens (the done event's usage). RTF = E2E / the clip's seconds. ``warmup``
  unmeasured requests run first, one at a time.
* Agreement pass (``agreement_requests`` > 0): after the timed runs, the first ``agreement_requests`` requests
  again, not timed, at the largest concurrency, with ``response_format=verbose_json`` (not streamable): each
  window's token ids (``segments[i].tokens``), compared with the baseline's window by window.
* Baseline ``transformers``: ``baseline(cfg)`` (the family's, from its bench plug-in in ``benchmarks/<family>/``)
  gives a ``TranscriptionBaseline`` that runs the same requests one at a time in this process after the engine
  runs (and after ``stop_server_pid``, when given, has exited: a quiet machine), with the server's windows
  (``window_seconds``, ``window_search_seconds``) and ``max_tokens``: set them to the served graph's.
* Report (``build_transcription_report``): per run, requests/s, audio seconds transcribed per wall second and
  output tokens/s (successful requests over the run's wall time, first start -> last end), TTFT / E2E / RTF
  p50/p95/p99/mean, failures; each engine run / the baseline (throughput ratios > 1 and latency ratios < 1 favour
  the engine); ``agreement``: windows whose tokens are identical (the agreement pass) and requests whose streamed
  transcript is identical to the baseline's (every engine run); the CPU calibration before the engine runs and
  before the baseline (a drift note above 10%). ``write_transcription_report`` writes
  ``transcription_bench_report.json`` and ``.png`` to ``out``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.bench.client import _error_message, chat_url, closed_loop, discover_model, progress_logger, read_sse
from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.report import (
    _ms, _num, _ratio, _table, plot_boxes_and_rate, stats, summarize, table_tail,
)
from omni_serve.bench.runner import BenchOutcome
from omni_serve.bench.server import baseline_phase

log = logging.getLogger(__name__)

REPORT_NAME = "transcription_bench_report"
SAMPLE_RATE = 16000  # Qwen3-ASR's feature extractor's rate: the clips need no resampling on either side
BASELINE_SYSTEM = "transformers"


class TranscriptionBenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the running server, e.g. http://127.0.0.1:8000.")
    checkpoint: str | None = Field(None, description="Local checkpoint directory of the in-process baseline.")
    model: str | None = Field(None, description="Model id in requests; default: the first id at /v1/models.")
    num_requests: int = Field(16, ge=1, description="Uploads per run.")
    concurrency: list[int] = Field(default_factory=lambda: [1, 8],
                                   description="Closed-loop sweep: uploads kept in flight, one run each.")
    audio_seconds: float = Field(10.0, gt=0, le=1200, description="Seconds of audio per upload.")
    language: str | None = Field("en", description=(
        "Language asked for (forced: the transcript streams from the first token); None: the model names it."))
    prompt: str | None = Field(None, description="Context prompt (the model's system turn), both systems.")
    max_tokens: int = Field(512, ge=1, description=(
        "The served graph's max_tokens (tokens per window at most): the baseline's max_new_tokens."))
    window_seconds: float = Field(30.0, ge=1, description="The served graph's window_seconds (the baseline's).")
    window_search_seconds: float = Field(5.0, ge=0, description=(
        "The served graph's window_search_seconds (the baseline's)."))
    seed: int = Field(0, ge=0, description="Workload seed; request i's clip is synthesized from seed + i.")
    warmup: int = Field(1, ge=0, description="Unmeasured requests per system first.")
    agreement_requests: int = Field(8, ge=0, description=(
        "Requests sent again (not timed) as verbose_json after the engine runs, for their window tokens; 0: none."))
    baseline: Literal["transformers", "none"] = Field("transformers", description="In-process baseline, or none.")
    threads: int | None = Field(None, ge=1, description="torch threads of the in-process baseline (default: all).")
    calibrate: bool = Field(True, description=(
        "Time a fixed CPU workload before the engine runs and before the baseline (omni_serve.bench.calibration)."))
    out: str = Field("bench_out", description=f"Directory for {REPORT_NAME}.json / .png.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout in seconds.")
    progress_every: int = Field(10, ge=0, description="Log progress every K requests (0: off).")
    stop_server_pid: int | None = Field(None, description=(
        "PID of the local server process: after the engine runs it gets SIGTERM and the baseline waits for it to "
        "exit, so the baseline runs on a quiet machine."))

    @model_validator(mode="after")
    def _check(self) -> "TranscriptionBenchConfig":
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency values must be >= 1")
        if self.window_search_seconds >= self.window_seconds:
            raise ValueError("window_search_seconds must be < window_seconds")
        if self.baseline == "transformers" and not self.checkpoint:
            raise ValueError("the transformers baseline needs --checkpoint (a local checkpoint directory)")
        return self


# --------------------------------------------------------------------------- workload


def synth_clip(seconds: float, seed: int, rate: int = SAMPLE_RATE):
    """A seeded float32 clip: two tones (the seed picks the pitch) and a little noise, silent while a slow sine is
    low (quiet gaps, where a long clip's windows can be cut)."""
    import numpy as np

    t = np.arange(int(round(seconds * rate))) / rate
    rng = np.random.default_rng(seed)
    freq = 160.0 + 40.0 * (seed % 11)
    x = 0.3 * np.sin(2 * np.pi * freq * t) + 0.2 * np.sin(2 * np.pi * 3.7 * freq * t) + 0.05 * rng.standard_normal(
        t.size)
    gate = np.sin(2 * np.pi * (0.5 + 0.05 * (seed % 7)) * t + seed) > -0.3
    return (x * gate).astype(np.float32)


def wav_bytes(samples, rate: int = SAMPLE_RATE) -> bytes:
    """16-bit PCM WAV of ``samples`` (what is uploaded, and what the baseline decodes)."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@dataclass(frozen=True)
class ClipRequest:
    index: int
    seed: int
    seconds: float
    wav: bytes = field(repr=False)
    language: str | None = None
    prompt: str | None = None

    def form(self, model: str | None, *, stream: bool, response_format: str = "json") -> dict[str, str]:
        """The multipart form's fields (the file aside)."""
        data = {"response_format": response_format}
        if stream:
            data["stream"] = "true"
        if model:
            data["model"] = model
        if self.language:
            data["language"] = self.language
        if self.prompt:
            data["prompt"] = self.prompt
        return data

    def files(self) -> dict[str, tuple[str, bytes, str]]:
        return {"file": (f"clip{self.index}.wav", self.wav, "audio/wav")}


def build_transcription_workload(cfg: TranscriptionBenchConfig) -> list[ClipRequest]:
    return [ClipRequest(index=i, seed=cfg.seed + i, seconds=cfg.audio_seconds,
                        wav=wav_bytes(synth_clip(cfg.audio_seconds, cfg.seed + i)), language=cfg.language,
                        prompt=cfg.prompt) for i in range(cfg.num_requests)]


# --------------------------------------------------------------------------- records

RECORD_KEYS = ("index", "ok", "start_s", "e2e_s", "ttft_s", "status", "error", "audio_seconds", "output_tokens",
               "token_source", "text_deltas", "text", "window_tokens", "compute_s")


@dataclass
class TranscriptionRecord(RequestRecord):
    """``audio_seconds`` is the *uploaded* clip's length (the report's RTF and audio s/s divide by it)."""

    text: str | None = None  # the whole transcript (the done event's, a verbose_json reply's, the baseline's)
    window_tokens: list[list[int]] | None = None  # per window (verbose_json and the baseline only)
    compute_s: float | None = None  # in-process baselines: generate's calls alone

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RECORD_KEYS}


@dataclass
class TranscriptionRunResult(RunResult):
    records: list[TranscriptionRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("label", "system", "mode", "concurrency", "wall_s", "streaming", "notes")}
        d["records"] = [r.to_dict() for r in self.records]
        return d


# --------------------------------------------------------------------------- HTTP engine


def transcriptions_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``/v1/audio/transcriptions``."""
    return chat_url(url)[: -len("/chat/completions")] + "/audio/transcriptions"


class TranscriptStream:
    """Folds the SSE ``data:`` payloads of one streamed transcription into a ``TranscriptionRecord``: ``feed(data,
    t)`` with each payload and its arrival (perf_counter seconds), ``finish(t_end)`` completes the record (ok once a
    ``transcript.text.done`` came and no error)."""

    def __init__(self, record: TranscriptionRecord, t_start: float):
        self.rec, self.t0 = record, t_start
        self.last_t: float | None = None
        self.done = False

    def feed(self, data: str, t: float) -> None:
        data = data.strip()
        if not data or data == "[DONE]":
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self._fail(f"unparseable stream event: {data[:120]!r}")
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            err = event["error"]
            msg = err.get("message") if isinstance(err, dict) else str(err)
            self._fail(f"stream error: {msg}")
        elif event.get("type") == "transcript.text.delta" and event.get("delta"):
            if self.last_t is None:
                self.rec.ttft_s = t - self.t0
            else:
                self.rec.itl_s.append(t - self.last_t)
            self.last_t = t
            self.rec.text_deltas += 1
        elif event.get("type") == "transcript.text.done":
            self.done = True
            self.rec.text = event.get("text") or ""
            usage = event.get("usage") or {}
            if usage.get("output_tokens") is not None:
                self.rec.output_tokens, self.rec.token_source = int(usage["output_tokens"]), "usage"

    def _fail(self, message: str) -> None:
        if self.rec.error is None:
            self.rec.error = message

    def finish(self, t_end: float) -> TranscriptionRecord:
        rec = self.rec
        rec.e2e_s = t_end - self.t0
        if rec.error is None and not self.done:
            rec.error = "stream ended without transcript.text.done"
        if rec.text is not None:
            rec.text_chars = len(rec.text)
        rec.ok = rec.error is None
        return rec


async def send_transcription(client: httpx.AsyncClient, url: str, req: ClipRequest, model: str | None, *,
                             stream: bool = True, response_format: str = "json",
                             t_run: float | None = None) -> TranscriptionRecord:
    """One upload to ``url`` (the transcriptions endpoint), streamed (``transcript.text.*`` events) or not (a
    ``json`` / ``verbose_json`` reply); never raises for request failures."""
    rec = TranscriptionRecord(index=req.index, audio_seconds=req.seconds)
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run if t_run is not None else 0.0
    acc = TranscriptStream(rec, t0)
    try:
        async with client.stream("POST", url, data=req.form(model, stream=stream, response_format=response_format),
                                 files=req.files()) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                rec.error = _error_message(resp.status_code, await resp.aread())
                rec.rejections = int(resp.status_code == 429)  # at capacity: rejected, counted apart from failures
                rec.e2e_s = time.perf_counter() - t0
                return rec
            if not stream:
                body = json.loads(await resp.aread())
                rec.e2e_s = rec.ttft_s = time.perf_counter() - t0
                rec.text = body["text"]
                rec.text_chars = len(rec.text)
                if "segments" in body:
                    rec.window_tokens = [list(s["tokens"]) for s in body["segments"]]
                    rec.output_tokens, rec.token_source = sum(map(len, rec.window_tokens)), "token_ids"
                elif (body.get("usage") or {}).get("output_tokens") is not None:
                    rec.output_tokens, rec.token_source = int(body["usage"]["output_tokens"]), "usage"
                rec.ok = True
                return rec
            await read_sse(resp, acc.feed)
    except httpx.TimeoutException as exc:
        rec.error = f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        rec.error = f"transport error: {type(exc).__name__}: {exc}"[:300]
    except (ValueError, KeyError, TypeError) as exc:  # a reply that is not the documented JSON
        rec.error = f"bad response: {type(exc).__name__}: {exc}"[:300]
        rec.e2e_s = time.perf_counter() - t0
        return rec
    return acc.finish(time.perf_counter())


async def run_transcription_load(url: str, requests: list[ClipRequest], model: str | None, concurrency: int, *,
                                 stream: bool = True, response_format: str = "json", timeout_s: float = 600.0,
                                 transport: httpx.AsyncBaseTransport | None = None, progress_every: int = 10,
                                 label: str | None = None) -> TranscriptionRunResult:
    """Closed loop: ``concurrency`` uploads in flight until all are answered; one record per request."""
    label = label or f"engine c={concurrency}"
    endpoint = transcriptions_url(url)

    async def send(client: httpx.AsyncClient, req: ClipRequest, t_run: float) -> TranscriptionRecord:
        try:
            return await asyncio.wait_for(send_transcription(client, endpoint, req, model, stream=stream,
                                                             response_format=response_format, t_run=t_run),
                                          timeout_s)
        except asyncio.TimeoutError:
            return TranscriptionRecord(index=req.index, e2e_s=timeout_s, audio_seconds=req.seconds,
                                       error=f"timeout: the request took over {timeout_s:g} s")

    on_done = progress_logger(label, len(requests), progress_every)
    records, wall = await closed_loop(requests, concurrency, send, on_done, timeout_s=timeout_s, transport=transport)
    final = [r or TranscriptionRecord(index=q.index, audio_seconds=q.seconds, error="request was never completed")
             for r, q in zip(records, requests)]
    return TranscriptionRunResult(label=label, system="engine", mode="transcription", concurrency=concurrency,
                                  wall_s=wall, streaming=stream, records=final)


# --------------------------------------------------------------------------- runner


class TranscriptionBaseline(Protocol):
    """An in-process transcription system: the same requests one at a time, after ``warmup`` unmeasured ones."""

    def run(self, requests: list[ClipRequest], warmup: int = 1,
            progress_every: int = 10) -> TranscriptionRunResult:
        """One run of every request (``system``: the baseline's name, ``transformers``)."""


def _engine_runs(cfg: TranscriptionBenchConfig, requests: list[ClipRequest],
                 model: str | None) -> tuple[list[TranscriptionRunResult], TranscriptionRunResult | None]:
    def load(reqs, concurrency, label=None, progress_every=cfg.progress_every, **kw):
        return asyncio.run(run_transcription_load(cfg.url, reqs, model, concurrency, timeout_s=cfg.timeout_s,
                                                  progress_every=progress_every, label=label, **kw))

    if cfg.warmup:
        w = load(requests[: cfg.warmup], 1, label="warmup", progress_every=0)
        if w.num_errors or w.num_rejected:
            log.warning("warm-up request failed: %s", next(r.error for r in w.records if not r.ok))
    runs = []
    for c in cfg.concurrency:
        log.info("engine run c=%d: %d uploads of %g s ...", c, len(requests), cfg.audio_seconds)
        runs.append(load(requests, c))
    agree = None
    if cfg.agreement_requests:
        log.info("agreement pass: %d uploads as verbose_json (not timed) ...", min(cfg.agreement_requests,
                                                                                   len(requests)))
        agree = load(requests[: cfg.agreement_requests], max(cfg.concurrency), label="agreement (verbose_json)",
                     progress_every=0, stream=False, response_format="verbose_json")
    return runs, agree


def run_transcription_bench(cfg: TranscriptionBenchConfig,
                            baseline: Callable[[TranscriptionBenchConfig], TranscriptionBaseline] | None = None,
                            ) -> BenchOutcome:
    from omni_serve.bench.calibration import calibrate
    from omni_serve.bench.machine import machine_info

    requests = build_transcription_workload(cfg)
    model = cfg.model or asyncio.run(discover_model(cfg.url))
    if model is None:
        log.warning("could not list models at %s; requests name no model (the server's default)", cfg.url)
    notes = [f"engine: {transcriptions_url(cfg.url)} model {model!r}, multipart upload of a {cfg.audio_seconds:g} s "
             f"16 kHz WAV, stream=true, language {cfg.language!r}; TTFT: the first non-empty transcript.text.delta, "
             "E2E: transcript.text.done; RTF = E2E / audio seconds"]
    machine = machine_info(cfg.url)
    calibration = {"engine": round(calibrate(), 5)} if cfg.calibrate and cfg.baseline != "none" else {}
    runs, agree_run = _engine_runs(cfg, requests, model)
    chosen = "transformers" if cfg.baseline == "transformers" else None
    runs += baseline_phase(cfg, requests, baseline, chosen, calibration, notes)
    config = {**cfg.model_dump(mode="json"), "machine": machine, "calibration_s": calibration}
    report = build_transcription_report(runs, agree_run, config=config, notes=notes)
    json_path, png_path = write_transcription_report(report, runs, cfg.out)
    return BenchOutcome(report=report, json_path=json_path, png_path=png_path,
                        table=format_transcription_table(report), runs=runs)


# --------------------------------------------------------------------------- report

SUMMARY_KEYS = ("label", "system", "concurrency", "streaming", "wall_s", "num_requests", "num_ok", "num_errors",
                "num_rejected", "errors_by_message", "errors", "audio_seconds", "output_tokens", "token_sources",
                "tokens_exact", "notes")


def summarize_transcription_run(run: TranscriptionRunResult) -> dict[str, Any]:
    s = summarize(run)
    out = {k: s[k] for k in SUMMARY_KEYS}
    lat = s["latency_s"]
    out.update(mode="transcription", throughput=dict(s["throughput"]),
               latency_s={"ttft": lat["ttft"], "e2e": lat["e2e"], "rtf": lat["rtf"], "itl": lat["itl"],
                          "compute": stats([r.compute_s for r in run.records if r.ok and r.compute_s is not None])})
    return out


def compare_transcription(engine: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    lat = {}
    for m in ("ttft", "e2e", "rtf"):
        e, b = engine["latency_s"][m], baseline["latency_s"][m]
        lat[m] = {s: _ratio(e[s], b[s]) for s in ("mean", "p50", "p95")} if e and b else {}
    return {"engine": engine["label"], "baseline": baseline["label"], "concurrency": engine["concurrency"],
            "throughput_ratio": {k: _ratio(engine["throughput"][k], baseline["throughput"][k])
                                 for k in ("requests_per_s", "audio_s_per_s", "output_tokens_per_s")},
            "latency_ratio": lat}


def agreement(engine_runs: list[TranscriptionRunResult], agree_run: TranscriptionRunResult | None,
              baseline_run: TranscriptionRunResult) -> dict[str, Any]:
    """Window tokens of the agreement pass vs the baseline's (per window, requests ok in both), and each engine
    run's transcripts vs the baseline's (per request ok in both)."""
    base = {r.index: r for r in baseline_run.records if r.ok}
    out: dict[str, Any] = {"baseline": baseline_run.label, "tokens": None, "text": {}}
    if agree_run is not None:
        compared = identical = 0
        differ = []
        for r in agree_run.records:
            b = base.get(r.index)
            if not r.ok or b is None or r.window_tokens is None or b.window_tokens is None:
                continue
            if len(r.window_tokens) != len(b.window_tokens):
                differ.append({"index": r.index, "windows": [len(r.window_tokens), len(b.window_tokens)]})
                compared += max(len(r.window_tokens), len(b.window_tokens))
                continue
            for w, (mine, theirs) in enumerate(zip(r.window_tokens, b.window_tokens)):
                compared += 1
                identical += mine == theirs
                if mine != theirs:
                    first = next((k for k, (x, y) in enumerate(zip(mine, theirs)) if x != y),
                                 min(len(mine), len(theirs)))
                    differ.append({"index": r.index, "window": w, "first_differing_token": first})
        out["tokens"] = {"run": agree_run.label, "requests": sum(r.ok for r in agree_run.records),
                         "failed": sum(not r.ok for r in agree_run.records), "windows_compared": compared,
                         "windows_identical": identical, "differing": differ[:20]}
    for run in engine_runs:
        pairs = [(r.text, base[r.index].text) for r in run.records if r.ok and r.index in base and r.text is not None]
        out["text"][run.label] = {"compared": len(pairs), "identical": sum(a == b for a, b in pairs)}
    return out


def build_transcription_report(runs: list[TranscriptionRunResult], agree_run: TranscriptionRunResult | None = None,
                               config: dict[str, Any] | None = None,
                               notes: list[str] | None = None) -> dict[str, Any]:
    summaries = {r.label: summarize_transcription_run(r) for r in runs}
    engine = [r for r in runs if r.system == "engine"]
    base = next((r for r in runs if r.system == BASELINE_SYSTEM), None)
    all_notes = list(notes or [])
    comparisons, agree = [], None
    if base is not None:
        comparisons = [compare_transcription(summaries[r.label], summaries[base.label]) for r in engine]
        all_notes.append("ratios are engine / baseline: throughput x > 1 and latency x < 1 favour the engine")
        agree = agreement(engine, agree_run, base)
    elif agree_run is not None:
        all_notes.append("the agreement pass ran, but there is no baseline to compare it with")
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config or {}, "notes": all_notes,
            "runs": list(summaries.values()), "comparisons": comparisons, "agreement": agree,
            "records": {r.label: [rec.to_dict() for rec in r.records]
                        for r in runs + ([agree_run] if agree_run is not None else [])}}


def format_transcription_table(report: dict[str, Any]) -> str:
    rows = []
    for s in report["runs"]:
        lat, tp = s["latency_s"], s["throughput"]
        ttft, e2e, rtf = (lat[m] or {} for m in ("ttft", "e2e", "rtf"))
        rows.append([s["label"], str(s["num_requests"]), str(s["num_errors"]), str(s["num_rejected"]),
                     _num(s["wall_s"], "{:.1f}"), _num(tp["requests_per_s"], "{:.3f}"),
                     _num(tp["audio_s_per_s"], "{:.2f}"), _num(tp["output_tokens_per_s"], "{:.1f}"),
                     _ms(ttft.get("p50")), _ms(ttft.get("p95")), _ms(e2e.get("p50")), _ms(e2e.get("p95")),
                     _num(rtf.get("p50"), "{:.4f}"), _num(rtf.get("p95"), "{:.4f}")])
    out = ["Runs (successful requests over each run's wall time; TTFT: first transcript.text.delta, E2E: "
           "transcript.text.done, ms; RTF = E2E / audio s)",
           _table(["run", "reqs", "errors", "429s", "wall s", "req/s", "audio s/s", "out tok/s", "TTFT p50", "p95",
                   "E2E p50", "p95", "RTF p50", "p95"], rows)]
    agree = report["agreement"] or {}
    if report["comparisons"]:
        crows = []
        for c in report["comparisons"]:
            t, lat = c["throughput_ratio"], c["latency_ratio"]
            same = agree.get("text", {}).get(c["engine"])
            crows.append([c["engine"], c["baseline"], _num(t["requests_per_s"]), _num(t["audio_s_per_s"]),
                          _num(lat["ttft"].get("p50")), _num(lat["ttft"].get("p95")), _num(lat["e2e"].get("p50")),
                          _num(lat["rtf"].get("p50")),
                          f"{same['identical']}/{same['compared']}" if same else "-"])
        out += ["", "Engine / baseline ratios (throughput x: >1 engine better; latency x: <1 engine better)",
                _table(["engine", "baseline", "req/s x", "audio s/s x", "TTFT p50 x", "TTFT p95 x", "E2E p50 x",
                        "RTF p50 x", "same text"], crows)]
    tokens = agree.get("tokens")
    if tokens:
        out += ["", f"Agreement ({tokens['run']}, {tokens['requests']} requests): {tokens['windows_identical']}/"
                    f"{tokens['windows_compared']} windows' tokens identical to {agree['baseline']}'s"
                + (f"; {tokens['failed']} failed" if tokens["failed"] else "")]
    return "\n".join(out + table_tail(report))


def plot_transcription_report(runs: list[TranscriptionRunResult], report: dict[str, Any], path: str) -> str:
    boxes = [(f"{r.label} {kind}", [getattr(x, f"{kind}_s") for x in r.records
                                    if x.ok and getattr(x, f"{kind}_s") is not None])
             for r in runs for kind in ("ttft", "e2e")]
    rate = {s["label"]: s["throughput"]["audio_s_per_s"] or 0 for s in report["runs"]}
    return plot_boxes_and_rate(runs, boxes, rate, path, "omni-serve bench --mode transcription",
                               "TTFT (first delta) and E2E per upload",
                               "audio seconds transcribed per second vs concurrency",
                               "concurrency (uploads in flight)", "audio s / s")


def write_transcription_report(report: dict[str, Any], runs: list[TranscriptionRunResult],
                               out_dir: str) -> tuple[str, str]:
    from omni_serve.bench.image_report import json_safe

    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{REPORT_NAME}.json")
    with open(json_path, "w") as f:
        json.dump(json_safe(report), f, indent=2, default=str, allow_nan=False)
    return json_path, plot_transcription_report(runs, report, os.path.join(out_dir, f"{REPORT_NAME}.png"))
