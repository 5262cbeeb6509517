"""What ``omni-serve bench`` runs for a chat endpoint: a validated ``BenchConfig`` -> engine runs + the family's
in-process runs -> report files.

Contract: ``run_bench(cfg, systems) -> BenchOutcome`` (report dict, JSON path, PNG path, printable table). ``systems``
(``InProcessSystems``) is the served family's bench plug-in's (``benchmarks/<family>/``): this module runs no model
itself and imports no family.

* ``mode="omni"``: every load point (the ``concurrency`` list, closed loop, and the ``request_rate`` list, open
  loop: with a rate and no chosen concurrency, the open-loop points alone) is replayed against ``url`` with the
  streaming HTTP client, a 429 sent again after its ``Retry-After`` (``retry_rejected``); then each baseline in
  ``baselines`` runs in-process, ``hf`` before ``cb`` (``systems.baseline_runs``).
* ``mode="text"``: thinker-only comparison on the same token-id prompts (``systems.text_prompts``): the family's
  engine runs first (``systems.text_engine_runs``: each thinker backend of ``thinker_backends`` at every load
  point), then each baseline (default ``cb``) at every load point. Every system runs with the same CPU threads:
  ``threads``, else torch's default (all cores); the report's ``config.threads_used`` says which.
* ``thinker_backends`` in omni mode names the running server's one thinker backend: it is recorded in the
  report's config and names the engine runs' system: ``engine`` (native) or ``engine_vllm`` (labels
  ``engine c=4`` / ``engine_vllm c=4``), so reports of both servers merge (``report.merge_reports``).
* The workload is the same for every system (``build_workload`` from ``seed``); baselines read the
  checkpoint from the local directory only.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.bench.records import RunResult
from omni_serve.bench.workload import BenchRequest, WorkloadConfig, build_workload
from omni_serve.engines.vllm_engine.config import VllmSettings

DEFAULT_KV_CACHE_GIB: float = VllmSettings.model_fields["kv_cache_gib"].default

log = logging.getLogger(__name__)


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["omni", "text"] = Field("omni", description="omni: HTTP engine vs generate; text: thinker only.")
    graph: str = Field("qwen2_5_omni", description=(
        "The served family (its bench plug-in runs the in-process systems), recorded in the report."))
    url: str | None = Field(None, description="Base URL of the running server (omni mode).")
    checkpoint: str | None = Field(None, description="Local checkpoint directory for the in-process baselines.")
    model: str | None = Field(None, description="Model name in requests; default: the first of /v1/models.")
    num_requests: int = Field(16, ge=1)
    concurrency: list[int] = Field(default_factory=lambda: [1], description=(
        "Closed-loop sweep; with request_rate and concurrency_given, also the open-loop cap."))
    concurrency_given: bool = Field(False, description=(
        "The concurrency was chosen (not the default): with request_rate, its closed-loop points run first and "
        "the open-loop points cap requests in flight at max(concurrency); otherwise only the open-loop points run, "
        "uncapped."))
    request_rate: list[float] | None = Field(None, description="Open-loop Poisson rates (requests/s); one run each.")
    retry_rejected: bool = Field(True, description=(
        "omni mode: send a request again after its 429's Retry-After (as a client would) until admitted or "
        "timeout_s has passed; the report counts the 429s and the waits, and latencies count from the admitted "
        "try. Off: a 429 is a rejected request (counted apart from failures)."))
    max_tokens: int = Field(64, ge=1)
    min_tokens: int = Field(0, ge=0, description="omni_serve's min_tokens extension; = max_tokens fixes lengths.")
    audio: bool = True
    voice: str = "Chelsie"
    temperature: float = Field(0.0, ge=0, le=2)
    seed: int = 0
    min_words: int = Field(4, ge=1)
    max_words: int = Field(48, ge=1)
    baselines: list[Literal["hf", "cb"]] = Field(default_factory=list)
    out: str = "bench_out"
    warmup: int = Field(1, ge=0, description="Unmeasured requests per system before measuring.")
    calibrate: bool = Field(True, description=(
        "With baselines: time a fixed CPU workload (omni_serve.bench.calibration) before the engine runs and again "
        "before the baselines, record both in the report's config (calibration_s) and add a note when they differ "
        "by more than 10% (machine-speed drift that skews the ratios)."))
    timeout_s: float = Field(600.0, gt=0)
    client_buffer_s: float = Field(0.5, ge=0, description=(
        "The listener's jitter buffer the report plays streamed audio with (stalls, headroom)."))
    progress_every: int = Field(10, ge=0)
    max_codec_tokens: int | None = Field(None, ge=1,
                                         description="HF talker max tokens (server: talker.max_codec_tokens).")
    num_steps: int | None = Field(None, ge=1, description="HF token2wav ODE steps (server: code2wav.num_steps).")
    system_prompt: str | None = None
    threads: int | None = Field(None, ge=1, description="torch threads for in-process baselines (default: all).")
    cb_page_size: int = Field(32, ge=4)
    cb_attn_implementation: str = "sdpa"
    stop_server_pid: int | None = Field(None, description=(
        "Local server to stop (SIGTERM, wait for exit) after the engine runs, so the baselines run on a quiet "
        "machine."))
    thinker_backends: list[Literal["native", "vllm"]] = Field(default_factory=lambda: ["native"], description=(
        "Thinker engines. Text mode: run each (native: AREngine in process; vllm: vLLM in the vLLM environment). "
        "Omni mode: the running server's one backend (stages.thinker.engine.backend), recorded in the report."))
    vllm_python: str | None = Field(None, description=(
        "Interpreter of the vLLM environment for text-mode vllm runs (default: $OMNI_SERVE_VLLM_PYTHON, else "
        ".venv-vllm/bin/python)."))
    vllm_kv_cache_gib: float = Field(DEFAULT_KV_CACHE_GIB, gt=0, description=(
        "KV cache of the text-mode vLLM engine in GiB (the served default of engine.vllm.kv_cache_gib)."))

    @model_validator(mode="after")
    def _check(self) -> "BenchConfig":
        if any(c < 1 for c in self.concurrency) or not self.concurrency:
            raise ValueError("concurrency values must be >= 1")
        if self.request_rate is not None and any(r <= 0 for r in self.request_rate):
            raise ValueError("request_rate values must be > 0")
        if self.mode == "omni" and not self.url:
            raise ValueError("omni mode needs --url (a running omni-serve endpoint)")
        if self.baselines and not self.checkpoint:
            raise ValueError("baselines need --checkpoint (a local checkpoint directory)")
        if self.mode == "text" and not self.checkpoint:
            raise ValueError("text mode needs --checkpoint")
        if "cb" in self.baselines and self.mode == "omni" and self.audio:
            raise ValueError("the cb baseline is text only: use --no-audio or --mode text")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        if "cb" in self.baselines and 0 < self.min_tokens < self.max_tokens:
            raise ValueError("the cb baseline supports --min-tokens only equal to --max-tokens (fixed lengths)")
        if self.min_words > self.max_words:
            raise ValueError("min_words must be <= max_words")
        if not self.thinker_backends or len(set(self.thinker_backends)) != len(self.thinker_backends):
            raise ValueError("thinker backends must be a non-empty list without repeats (native, vllm)")
        if self.mode == "omni" and len(self.thinker_backends) != 1:
            raise ValueError("omni mode benchmarks the running server's one thinker backend: "
                             "--thinker-backend native or vllm")
        return self

    def engine_system(self) -> str:
        """Omni mode: the system name of the engine runs (``engine``, or ``engine_vllm`` for a vLLM thinker)."""
        return "engine" if self.thinker_backends[0] == "native" else "engine_vllm"

    def workload(self) -> WorkloadConfig:
        return WorkloadConfig(num_requests=self.num_requests, seed=self.seed, max_tokens=self.max_tokens,
                              min_tokens=self.min_tokens,
                              audio=self.audio and self.mode == "omni", voice=self.voice,
                              temperature=self.temperature, min_words=self.min_words, max_words=self.max_words)

    def points(self):
        from omni_serve.bench.client import LoadPoint

        closed = [LoadPoint(concurrency=c) for c in self.concurrency]
        if not self.request_rate:
            return closed
        cap = max(self.concurrency) if self.concurrency_given else None
        return (closed if self.concurrency_given else []) + [LoadPoint(concurrency=cap, request_rate=r)
                                                              for r in self.request_rate]


class InProcessSystems(Protocol):
    """A family's in-process systems, from its bench plug-in: what ``run_bench`` compares the endpoint with."""

    def text_prompts(self, cfg: BenchConfig, requests: list[BenchRequest]) -> list[list[int]]:
        """Text mode: the token-id prompts of ``requests`` (what the served ingress would prefill)."""

    def text_engine_runs(self, cfg: BenchConfig, prompts: list[list[int]], threads: int) -> list[RunResult]:
        """Text mode: the family's own engine(s) in process, every load point of ``cfg``."""

    def baseline_runs(self, system: str, cfg: BenchConfig, requests: list[BenchRequest],
                      prompts: list[list[int]] | None = None) -> list[RunResult]:
        """The runs of baseline ``system`` (e.g. ``hf``, ``cb``); ``prompts``: text mode's, else None."""


@dataclass
class BenchOutcome:
    report: dict[str, Any]
    json_path: str
    png_path: str
    table: str
    runs: list[RunResult]


def _engine_omni_runs(cfg: BenchConfig, requests) -> tuple[list[RunResult], list[str]]:
    from omni_serve.bench.client import discover_model, run_load, warmup

    notes = []
    model = cfg.model or asyncio.run(discover_model(cfg.url))
    if model is None:
        log.warning("could not list models at %s; using 'qwen2.5-omni'", cfg.url)
        model = "qwen2.5-omni"
    system = cfg.engine_system()
    notes.append(f"{system}: {cfg.url} model {model!r}, thinker backend {cfg.thinker_backends[0]}, streaming chat "
                 "completions (stream_options.include_usage for exact token counts)")
    if cfg.warmup:
        log.info("warming up the engine with %d request(s) ...", cfg.warmup)
        w = asyncio.run(warmup(cfg.url, requests, model, cfg.warmup, timeout_s=cfg.timeout_s))
        if not all(r.ok for r in w):
            log.warning("warm-up request failed: %s", next(r.error for r in w if not r.ok))
    runs = []
    for point in cfg.points():
        log.info("engine run %s: %d requests ...", point.label(system), len(requests))
        run = asyncio.run(run_load(cfg.url, requests, model, point, arrival_seed=cfg.seed, timeout_s=cfg.timeout_s,
                                   progress_every=cfg.progress_every, label=point.label(system),
                                   retry_rejected=cfg.retry_rejected))
        run.system, run.client_buffer_s = system, cfg.client_buffer_s
        runs.append(run)
    return runs, notes


def _text_threads(cfg: BenchConfig) -> int:
    """The CPU threads of every text-mode system: ``threads``, else torch's default (set for this process)."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return torch.get_num_threads()


def _calibration(cfg: BenchConfig, extra: dict[str, Any], phase: str, notes: list[str]) -> None:
    """Time the calibration workload for ``phase`` ("engine", then "baseline") when the run compares systems."""
    if not (cfg.calibrate and (cfg.baselines or cfg.mode != "omni")):  # text mode always has a baseline (cb)
        return
    from omni_serve.bench.calibration import calibrate, drift_note

    seconds = extra.setdefault("calibration_s", {})
    seconds[phase] = round(calibrate(), 5)
    log.info("calibration before the %s runs: %.1f ms", phase, seconds[phase] * 1000)
    if phase == "baseline" and "engine" in seconds:
        note = drift_note(seconds["engine"], seconds["baseline"])
        if note:
            log.warning(note)
            notes.append(note)


def run_bench(cfg: BenchConfig, systems: InProcessSystems | None = None) -> BenchOutcome:
    from omni_kernels import kernel_paths

    from omni_serve.bench.machine import machine_info
    from omni_serve.bench.report import build_report, format_table, write_report

    if systems is None and (cfg.baselines or cfg.mode == "text"):
        raise ValueError(f"the {cfg.graph} bench gave no in-process systems for its baselines or text mode")
    requests = build_workload(cfg.workload())
    runs: list[RunResult] = []
    notes: list[str] = []
    extra: dict[str, Any] = {"machine": machine_info(cfg.url if cfg.mode == "omni" else None)}
    _calibration(cfg, extra, "engine", notes)
    if cfg.mode == "omni":
        engine_runs, engine_notes = _engine_omni_runs(cfg, requests)
        runs += engine_runs
        notes += engine_notes
        if cfg.stop_server_pid is not None:
            from omni_serve.bench.server import stop_server

            stop_server(cfg.stop_server_pid)
            notes.append("the server was stopped before the baselines ran")
        _calibration(cfg, extra, "baseline", notes)
        for system in [s for s in ("hf", "cb") if s in cfg.baselines]:
            runs += systems.baseline_runs(system, cfg, requests)
    else:
        threads = _text_threads(cfg)
        extra["threads_used"] = threads
        prompts = systems.text_prompts(cfg, requests)
        runs += systems.text_engine_runs(cfg, prompts, threads)
        extra["machine"]["stages"]["this process"] = kernel_paths()
        _calibration(cfg, extra, "baseline", notes)
        for system in cfg.baselines or ["cb"]:
            runs += systems.baseline_runs(system, cfg, requests, prompts)
    config = {**cfg.model_dump(mode="json"), **extra}
    report = build_report(runs, config=config, notes=notes)
    json_path, png_path = write_report(report, runs, cfg.out)
    return BenchOutcome(report=report, json_path=json_path, png_path=png_path, table=format_table(report), runs=runs)
