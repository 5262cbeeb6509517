"""``omni-serve bench --mode video``: OpenAI's Videos API (a job API) against a running endpoint vs the family's
diffusers pipeline in process.

Contract: ``run_video_bench(VideoBenchConfig, baseline) -> BenchOutcome`` (the runner's: report dict, JSON path,
PNG path, printable table, runs).

* Workload (``build_video_workload``): a pure function of the config. ``num_requests`` prompts of 4 to 12 words
  (``omni_serve.bench.workload.WORDS`` after one of ``omni_serve.bench.image.STYLES``, drawn with
  ``random.Random(seed)``); request ``i`` uses noise seed ``seed + i`` and the config's size, ``num_frames``,
  ``fps``, steps, ``guidance_scale`` and ``negative_prompt``. A video lasts ``num_frames / fps`` seconds.
* Engine runs (``run_video_load``): per ``concurrency`` value, a closed loop keeping C jobs in flight
  (``httpx.AsyncClient``). Each worker creates a job (``POST /v1/videos``, a JSON body, ``output_format: mp4``),
  polls ``GET /v1/videos/{id}`` every ``poll_s`` until it is ``completed`` (``failed``: the job's error), downloads
  ``GET /v1/videos/{id}/content`` and only then takes the next request. Per job (``VideoRecord``): ok or the error
  (HTTP status + OpenAI error message, a failed job, transport error, timeout, an MP4 without ``num_frames``
  decodable frames; failures are counted, never dropped; a 429 is *rejected*, counted apart and not sent again),
  E2E (create sent -> MP4 downloaded: the polling delay and the download are in it; decoding the MP4 to check it
  is not), the create call's and the download's own times, the polls and the MP4's bytes. ``warmup`` unmeasured
  jobs run first, one at a time.
* Baseline ``diffusers``: ``baseline(cfg)`` (the family's, from its bench plug-in in ``benchmarks/<family>/``) gives
  a ``VideoBaseline`` that runs the same requests one at a time in this process after the engine runs (and after
  ``stop_server_pid``, when given, has exited: a quiet machine). ``VideoRequest.pipeline_kwargs`` are the
  requests' diffusers pipeline arguments.
* Report (``build_video_report``): per run, videos/hour and seconds of video per second (successful jobs over the
  run's wall time, first start -> last end), E2E p50/p95/p99/mean, failures; each engine run / the ``diffusers``
  run (throughput ratios > 1 and E2E ratios < 1 favour the engine); ``agreement``: per request of the first
  engine run, PSNR and max abs difference of its decoded frames vs the baseline's (both decoded from an MP4 of
  the same encoder); the CPU calibration before the engine runs and before the baseline (a drift note above
  10%). ``write_video_report`` writes ``video_bench_report.json`` and ``.png`` to ``out``.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omni_serve.bench.client import _error_message, chat_url, closed_loop, discover_model, progress_logger
from omni_serve.bench.image import STYLES
from omni_serve.bench.image_report import json_safe, max_abs_diff, psnr
from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.report import (
    _ms, _num, _ratio, _table, plot_boxes_and_rate, stats, summarize, table_tail,
)
from omni_serve.bench.runner import BenchOutcome
from omni_serve.bench.server import baseline_phase
from omni_serve.bench.workload import WORDS
from omni_serve.kits.diffusion.spec import size_dimensions

log = logging.getLogger(__name__)

REPORT_NAME = "video_bench_report"


class VideoBenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="Base URL of the running server, e.g. http://127.0.0.1:8000.")
    checkpoint: str | None = Field(None, description="Local checkpoint directory of the in-process baseline.")
    model: str | None = Field(None, description="Model id in requests; default: the first id at /v1/models.")
    num_requests: int = Field(8, ge=1, description="Jobs per run.")
    concurrency: list[int] = Field(default_factory=lambda: [1, 4],
                                   description="Closed-loop sweep: jobs kept in flight, one run each.")
    size: str = Field("128x128", description="Video size 'WIDTHxHEIGHT'.")
    num_frames: int = Field(17, ge=1, description="Frames per video (Wan: 4k + 1).")
    fps: int = Field(16, ge=1, le=120, description="Frames per second: a video lasts num_frames / fps seconds.")
    steps: int = Field(20, ge=1, description="num_inference_steps per video.")
    guidance_scale: float = Field(5.0, ge=0, description="CFG scale (none at 1 or below), both systems.")
    negative_prompt: str | None = Field(None, description="Negative prompt (None: the empty one, under CFG).")
    seed: int = Field(0, ge=0, description="Workload seed; request i uses noise seed seed + i.")
    warmup: int = Field(1, ge=0, description="Unmeasured jobs per system first.")
    poll_s: float = Field(0.25, gt=0, description="Seconds between two GET /v1/videos/{id} of one job.")
    baseline: Literal["diffusers", "none"] = Field("diffusers", description="In-process baseline, or none.")
    threads: int | None = Field(None, ge=1, description="torch threads of the in-process baseline (default: all).")
    baseline_dtype: Literal["float32", "bfloat16"] = Field("float32", description=(
        "dtype of the in-process baseline pipeline; set it to the served stages' engine.dtype."))
    calibrate: bool = Field(True, description=(
        "Time a fixed CPU workload before the engine runs and before the baseline (omni_serve.bench.calibration)."))
    out: str = Field("bench_out", description=f"Directory for {REPORT_NAME}.json / .png.")
    timeout_s: float = Field(600.0, gt=0, description="Per-job timeout in seconds (create to download).")
    progress_every: int = Field(10, ge=0, description="Log progress every K jobs (0: off).")
    stop_server_pid: int | None = Field(None, description=(
        "PID of the local server process: after the engine runs it gets SIGTERM and the baseline waits for it to "
        "exit, so the baseline runs on a quiet machine."))

    @field_validator("size")
    @classmethod
    def _size(cls, value: str) -> str:
        if not all(size_dimensions(value) or (0,)):
            raise ValueError("size must be 'WIDTHxHEIGHT', e.g. 128x128")
        return value

    @model_validator(mode="after")
    def _check(self) -> "VideoBenchConfig":
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError("concurrency values must be >= 1")
        if self.baseline == "diffusers" and not self.checkpoint:
            raise ValueError("the diffusers baseline needs --checkpoint (a local checkpoint directory)")
        return self

    def dimensions(self) -> tuple[int, int]:
        """(width, height) of ``size``."""
        return size_dimensions(self.size)


# --------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class VideoRequest:
    index: int
    prompt: str
    seed: int
    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    guidance_scale: float
    negative_prompt: str | None = None

    @property
    def video_seconds(self) -> float:
        return self.num_frames / self.fps

    def body(self, model: str | None) -> dict[str, Any]:
        """The ``POST /v1/videos`` JSON."""
        body: dict[str, Any] = {"prompt": self.prompt, "size": f"{self.width}x{self.height}",
                                "num_frames": self.num_frames, "fps": self.fps, "num_inference_steps": self.steps,
                                "guidance_scale": self.guidance_scale, "seed": self.seed, "output_format": "mp4"}
        if model:
            body["model"] = model
        if self.negative_prompt is not None:
            body["negative_prompt"] = self.negative_prompt
        return body

    def pipeline_kwargs(self) -> dict[str, Any]:
        """The video pipeline's ``__call__`` arguments (``WanPipeline``'s), the generator aside, matching ``body``."""
        kw: dict[str, Any] = {"prompt": self.prompt, "width": self.width, "height": self.height,
                              "num_frames": self.num_frames, "num_inference_steps": self.steps,
                              "guidance_scale": self.guidance_scale, "output_type": "np"}
        if self.negative_prompt is not None:
            kw["negative_prompt"] = self.negative_prompt
        return kw


def build_video_workload(cfg: VideoBenchConfig) -> list[VideoRequest]:
    rng = random.Random(cfg.seed)
    width, height = cfg.dimensions()
    out = []
    for i in range(cfg.num_requests):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        out.append(VideoRequest(index=i, prompt=f"{rng.choice(STYLES)} {words}", seed=cfg.seed + i, width=width,
                                height=height, num_frames=cfg.num_frames, fps=cfg.fps, steps=cfg.steps,
                                guidance_scale=cfg.guidance_scale, negative_prompt=cfg.negative_prompt))
    return out


# --------------------------------------------------------------------------- records

RECORD_KEYS = ("index", "ok", "start_s", "e2e_s", "status", "error", "video_seconds", "num_frames", "bytes",
               "create_s", "download_s", "polls", "compute_s")


@dataclass
class VideoRecord(RequestRecord):
    video_seconds: float = 0.0  # of a successful job: its frames / fps
    num_frames: int = 0  # decoded from the MP4
    bytes: int = 0  # the MP4's
    create_s: float | None = None  # POST /v1/videos answered
    download_s: float | None = None  # GET .../content, request to last byte
    polls: int = 0  # GET /v1/videos/{id} calls
    compute_s: float | None = None  # in-process baselines: the pipeline call alone (E2E adds the MP4 encoding)
    frames: Any = field(default=None, repr=False)  # uint8 [F, H, W, 3] decoded from the MP4; never serialized

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in RECORD_KEYS}


@dataclass
class VideoRunResult(RunResult):
    records: list[VideoRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("label", "system", "mode", "concurrency", "wall_s", "notes")}
        d["records"] = [r.to_dict() for r in self.records]
        return d


def decode_mp4(data: bytes):
    """The frames of an MP4 as uint8 RGB [F, H, W, 3]."""
    import av
    import numpy as np

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def check_video(rec: VideoRecord, data: bytes, req: VideoRequest) -> None:
    """Decode the MP4 into ``rec`` (ok when it has the request's frame count and size), else its error."""
    rec.bytes = len(data)
    try:
        frames = decode_mp4(data)
    except Exception as exc:  # noqa: BLE001 - anything PyAV raises on a bad file is the server's failure here
        rec.error = f"bad MP4: {type(exc).__name__}: {exc}"[:300]
        return
    if frames.shape[:3] != (req.num_frames, req.height, req.width):
        rec.error = (f"expected {req.num_frames} frames of {req.width}x{req.height}, got "
                     f"{frames.shape[0]} of {frames.shape[2]}x{frames.shape[1]}")
        return
    rec.frames, rec.num_frames, rec.video_seconds, rec.ok = frames, frames.shape[0], req.video_seconds, True


# --------------------------------------------------------------------------- HTTP engine


def videos_url(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> the Videos API's ``/v1/videos``."""
    return chat_url(url)[: -len("/chat/completions")] + "/videos"


class _JobFailed(Exception):
    """A failed job, an unexpected answer on the way: the record's error."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


async def _job_done(client: httpx.AsyncClient, job_url: str, poll_s: float, rec: VideoRecord) -> None:
    """Poll the job until it is completed (returns) or failed (raises)."""
    while True:
        await asyncio.sleep(poll_s)
        resp = await client.get(job_url)
        rec.polls += 1
        if resp.status_code != 200:
            raise _JobFailed(_error_message(resp.status_code, resp.content), resp.status_code)
        job = resp.json()
        if job.get("status") == "completed":
            return
        if job.get("status") == "failed":
            err = job.get("error") or {}
            raise _JobFailed(f"job failed: {err.get('code')}: {err.get('message')}")


async def send_video(client: httpx.AsyncClient, url: str, req: VideoRequest, model: str | None, *,
                     poll_s: float = 0.25, t_run: float | None = None) -> VideoRecord:
    """One job at ``url`` (the Videos API): create, poll, download; never raises for request failures."""
    rec = VideoRecord(index=req.index)
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run if t_run is not None else 0.0
    data = None
    try:
        resp = await client.post(url, json=req.body(model))
        rec.create_s, rec.status = time.perf_counter() - t0, resp.status_code
        if resp.status_code != 200:
            rec.rejections = int(resp.status_code == 429)  # at capacity: rejected, counted apart from failures
            raise _JobFailed(_error_message(resp.status_code, resp.content), resp.status_code)
        job_url = f"{url}/{resp.json()['id']}"
        await _job_done(client, job_url, poll_s, rec)
        t_get = time.perf_counter()
        resp = await client.get(f"{job_url}/content")
        rec.status = resp.status_code
        if resp.status_code != 200:
            raise _JobFailed(_error_message(resp.status_code, resp.content), resp.status_code)
        data = resp.content
        rec.download_s = time.perf_counter() - t_get
    except _JobFailed as exc:
        rec.error, rec.status = str(exc), exc.status if exc.status is not None else rec.status
    except httpx.TimeoutException as exc:
        rec.error = f"timeout: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        rec.error = f"transport error: {type(exc).__name__}: {exc}"[:300]
    except (ValueError, KeyError, TypeError) as exc:  # bad JSON
        rec.error = f"bad response: {type(exc).__name__}: {exc}"[:300]
    rec.e2e_s = time.perf_counter() - t0
    if data is not None:
        check_video(rec, data, req)
    return rec


async def run_video_load(url: str, requests: list[VideoRequest], model: str | None, concurrency: int, *,
                         poll_s: float = 0.25, timeout_s: float = 600.0,
                         transport: httpx.AsyncBaseTransport | None = None, progress_every: int = 10,
                         label: str | None = None) -> VideoRunResult:
    """Closed loop: ``concurrency`` jobs in flight until all are done; one record per request."""
    label = label or f"engine c={concurrency}"
    endpoint = videos_url(url)

    async def send(client: httpx.AsyncClient, req: VideoRequest, t_run: float) -> VideoRecord:
        try:
            return await asyncio.wait_for(send_video(client, endpoint, req, model, poll_s=poll_s, t_run=t_run),
                                          timeout_s)
        except asyncio.TimeoutError:
            return VideoRecord(index=req.index, start_s=0.0, e2e_s=timeout_s,
                               error=f"timeout: the job took over {timeout_s:g} s")

    on_done = progress_logger(label, len(requests), progress_every)
    records, wall = await closed_loop(requests, concurrency, send, on_done, timeout_s=timeout_s, transport=transport)
    final = [r or VideoRecord(index=q.index, error="request was never completed") for r, q in zip(records, requests)]
    return VideoRunResult(label=label, system="engine", mode="video", concurrency=concurrency, wall_s=wall,
                          streaming=False, records=final)


# --------------------------------------------------------------------------- runner


class VideoBaseline(Protocol):
    """An in-process video system: the same requests one at a time, after ``warmup`` unmeasured ones."""

    def run(self, requests: list[VideoRequest], warmup: int = 1, progress_every: int = 10) -> VideoRunResult:
        """One run of every request (``system`` names the baseline, e.g. ``diffusers``)."""


def _engine_runs(cfg: VideoBenchConfig, requests: list[VideoRequest], model: str | None) -> list[VideoRunResult]:
    def load(reqs, concurrency, label=None, progress_every=cfg.progress_every):
        return asyncio.run(run_video_load(cfg.url, reqs, model, concurrency, poll_s=cfg.poll_s,
                                          timeout_s=cfg.timeout_s, progress_every=progress_every, label=label))

    if cfg.warmup:
        w = load(requests[: cfg.warmup], 1, label="warmup", progress_every=0)
        if w.num_errors or w.num_rejected:
            log.warning("warm-up job failed: %s", next(r.error for r in w.records if not r.ok))
    runs = []
    for c in cfg.concurrency:
        log.info("engine run c=%d: %d jobs ...", c, len(requests))
        runs.append(load(requests, c))
    return runs


def run_video_bench(cfg: VideoBenchConfig,
                    baseline: Callable[[VideoBenchConfig], VideoBaseline] | None = None) -> BenchOutcome:
    from omni_serve.bench.calibration import calibrate
    from omni_serve.bench.machine import machine_info

    requests = build_video_workload(cfg)
    model = cfg.model or asyncio.run(discover_model(cfg.url))
    if model is None:
        log.warning("could not list models at %s; requests name no model (the server's default)", cfg.url)
    notes = [f"engine: {videos_url(cfg.url)} model {model!r}, JSON create body, output_format mp4; a job polled "
             f"every {cfg.poll_s:g} s, its E2E from the create call to the MP4 downloaded"]
    machine = machine_info(cfg.url)
    calibration = {"engine": round(calibrate(), 5)} if cfg.calibrate and cfg.baseline != "none" else {}
    runs = _engine_runs(cfg, requests, model)
    chosen = "diffusers" if cfg.baseline == "diffusers" else None
    runs += baseline_phase(cfg, requests, baseline, chosen, calibration, notes)
    config = {**cfg.model_dump(mode="json"), "machine": machine, "calibration_s": calibration}
    report = build_video_report(runs, config=config, notes=notes)
    json_path, png_path = write_video_report(report, runs, cfg.out)
    return BenchOutcome(report=report, json_path=json_path, png_path=png_path, table=format_video_table(report),
                        runs=runs)


# --------------------------------------------------------------------------- report

SUMMARY_KEYS = ("label", "system", "concurrency", "wall_s", "num_requests", "num_ok", "num_errors", "num_rejected",
                "errors_by_message", "errors", "notes")


def summarize_video_run(run: VideoRunResult) -> dict[str, Any]:
    s = summarize(run)
    ok = [r for r in run.records if r.ok]
    video_s = sum(r.video_seconds for r in ok)
    wall = run.wall_s
    out = {k: s[k] for k in SUMMARY_KEYS}
    out.update(mode="video", num_videos=len(ok), video_seconds=video_s,
               throughput={"videos_per_hour": 3600 * len(ok) / wall if wall > 0 else None,
                           "video_s_per_s": video_s / wall if wall > 0 else None},
               latency_s={"e2e": s["latency_s"]["e2e"], "create": stats([r.create_s for r in ok]),
                          "download": stats([r.download_s for r in ok]), "compute": stats([r.compute_s for r in ok])},
               polls_per_video=stats([r.polls for r in ok]), mp4_bytes=stats([r.bytes for r in ok]))
    return out


def compare_video(engine: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    e, b = engine["latency_s"]["e2e"], baseline["latency_s"]["e2e"]
    return {"engine": engine["label"], "baseline": baseline["label"], "concurrency": engine["concurrency"],
            "throughput_ratio": {k: _ratio(engine["throughput"][k], baseline["throughput"][k])
                                 for k in ("videos_per_hour", "video_s_per_s")},
            "e2e_ratio": {s: _ratio(e[s], b[s]) for s in ("mean", "p50", "p95")} if e and b else {}}


def agreement(engine_run: VideoRunResult, baseline_run: VideoRunResult) -> dict[str, Any]:
    """Per request ok in both with frames of one shape: PSNR (dB) and max abs uint8 difference of the frames."""
    base = {r.index: r.frames for r in baseline_run.records if r.ok and r.frames is not None}
    pairs = {r.index: (r.frames, base[r.index]) for r in engine_run.records
             if r.ok and r.frames is not None and r.index in base and r.frames.shape == base[r.index].shape}
    values = {i: psnr(a, b) for i, (a, b) in pairs.items()}
    diffs = {i: max_abs_diff(a, b) for i, (a, b) in pairs.items()}
    finite = [v for v in values.values() if v != float("inf")]
    return {"engine": engine_run.label, "baseline": baseline_run.label, "compared": len(values),
            "identical": sum(d == 0 for d in diffs.values()), "psnr_db_min": min(finite) if finite else None,
            "psnr_db_mean_finite": sum(finite) / len(finite) if finite else None,
            "max_abs_diff": max(diffs.values()) if diffs else None, "per_request_psnr_db": values}


def build_video_report(runs: list[VideoRunResult], config: dict[str, Any] | None = None,
                       notes: list[str] | None = None) -> dict[str, Any]:
    summaries = {r.label: summarize_video_run(r) for r in runs}
    engine = [r for r in runs if r.system == "engine"]
    base = next((r for r in runs if r.system == "diffusers"), None)
    all_notes = list(notes or [])
    comparisons, agree = [], None
    if base is not None:
        comparisons = [compare_video(summaries[r.label], summaries[base.label]) for r in engine]
        all_notes.append("ratios are engine / baseline: videos/h x > 1 and E2E x < 1 favour the engine")
        if engine:
            agree = agreement(engine[0], base)
            all_notes.append(f"agreement: {engine[0].label}'s frames vs {base.label}'s, each decoded from an MP4 of "
                             "the same encoder (identical: every pixel equal)")
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config or {}, "notes": all_notes,
            "runs": list(summaries.values()), "comparisons": comparisons, "agreement": agree,
            "records": {r.label: [rec.to_dict() for rec in r.records] for r in runs}}


def format_video_table(report: dict[str, Any]) -> str:
    rows = []
    for s in report["runs"]:
        e2e, lat = s["latency_s"]["e2e"] or {}, s["latency_s"]
        rows.append([s["label"], str(s["num_requests"]), str(s["num_errors"]), str(s["num_rejected"]),
                     _num(s["wall_s"], "{:.1f}"), _num(s["throughput"]["videos_per_hour"], "{:.1f}"),
                     _num(s["throughput"]["video_s_per_s"], "{:.4f}"),
                     *(_ms(e2e.get(k)) for k in ("p50", "p95", "mean")), _ms((lat["download"] or {}).get("mean")),
                     _num((s["polls_per_video"] or {}).get("mean"), "{:.1f}")])
    out = ["Runs (successful jobs over each run's wall time; E2E: create -> MP4 downloaded, ms)",
           _table(["run", "jobs", "errors", "429s", "wall s", "videos/h", "video s/s", "E2E p50", "p95", "mean",
                   "download", "polls"], rows)]
    if report["comparisons"]:
        out += ["", "Engine / baseline ratios (videos/h x: >1 engine better; E2E x: <1 engine better)",
                _table(["engine", "baseline", "videos/h x", "video s/s x", "E2E p50 x", "E2E mean x"],
                       [[c["engine"], c["baseline"], _num(c["throughput_ratio"]["videos_per_hour"]),
                         _num(c["throughput_ratio"]["video_s_per_s"]), _num(c["e2e_ratio"].get("p50")),
                         _num(c["e2e_ratio"].get("mean"))] for c in report["comparisons"]])]
    a = report["agreement"]
    if a:
        out += ["", f"Agreement {a['engine']} vs {a['baseline']}: {a['compared']} videos compared, {a['identical']} "
                    f"identical, max abs pixel diff {_num(a['max_abs_diff'], '{}')}, PSNR min "
                    f"{_num(a['psnr_db_min'], '{:.1f}')} dB over the others"]
    return "\n".join(out + table_tail(report))


def plot_video_report(runs: list[VideoRunResult], report: dict[str, Any], path: str) -> str:
    rate = {s["label"]: s["throughput"]["videos_per_hour"] or 0 for s in report["runs"]}
    return plot_boxes_and_rate(runs, [(r.label, [x.e2e_s for x in r.records if x.ok]) for r in runs], rate, path,
                               "omni-serve bench --mode video", "E2E per video (create -> MP4 downloaded)",
                               "videos/hour vs concurrency", "concurrency (jobs in flight)", "videos/hour")


def write_video_report(report: dict[str, Any], runs: list[VideoRunResult], out_dir: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, f"{REPORT_NAME}.json")
    with open(json_path, "w") as f:
        json.dump(json_safe(report), f, indent=2, default=str, allow_nan=False)
    return json_path, plot_video_report(runs, report, os.path.join(out_dir, f"{REPORT_NAME}.png"))
