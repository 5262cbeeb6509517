"""What ``omni-serve bench`` runs: a validated ``BenchConfig`` -> engine runs + baseline runs -> report files.

Contract: ``run_bench(cfg) -> BenchOutcome`` (report dict, JSON path, PNG path, printable table).

* ``mode="omni"``: every load point (``concurrency`` list, or ``request_rate`` list for open loop) is
  replayed against ``url`` with the streaming HTTP client; then each baseline in ``baselines`` runs
  in-process: ``hf`` (``Qwen2_5OmniForConditionalGeneration.generate`` one request at a time), or ``cb``
  (transformers continuous batching of the thinker; text only, so only with ``audio=False``).
* ``mode="text"``: thinker-only comparison on the same token-id prompts: each thinker backend of
  ``thinker_backends`` at every load point, in that order (``native``: ``AREngine`` in process,
  ``omni_serve.bench.engine_text.run_engine_text``; ``vllm``: vLLM's ``AsyncLLM`` in the vLLM environment's
  interpreter, ``omni_serve.bench.vllm_text.run_vllm_text``; a failed vLLM subprocess becomes a run of failed
  requests), then ``cb`` at every load point (and ``hf`` text-only generate if asked). Every system runs with the
  same CPU threads: ``threads``, else torch's default (all cores); the report's ``config.threads_used`` says which.
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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omni_serve.bench.records import RunResult
from omni_serve.bench.workload import WorkloadConfig, build_workload
from omni_serve.engines.vllm_engine.config import VllmSettings

DEFAULT_KV_CACHE_GIB: float = VllmSettings.model_fields["kv_cache_gib"].default

log = logging.getLogger(__name__)


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["omni", "text"] = Field("omni", description="omni: HTTP engine vs generate; text: thinker only.")
    graph: Literal["qwen2_5_omni", "qwen3_omni"] = Field("qwen2_5_omni", description=(
        "The served Omni family (omni mode): its transformers generate is the hf baseline."))
    url: str | None = Field(None, description="Base URL of the running server (omni mode).")
    checkpoint: str | None = Field(None, description="Local checkpoint directory for the in-process baselines.")
    model: str | None = Field(None, description="Model name in requests; default: the first of /v1/models.")
    num_requests: int = Field(16, ge=1)
    concurrency: list[int] = Field(default_factory=lambda: [1], description="Closed-loop sweep (or open-loop cap).")
    concurrency_given: bool = Field(False, description="Open loop: cap requests in flight at max(concurrency).")
    request_rate: list[float] | None = Field(None, description="Open-loop Poisson rates (requests/s); one run each.")
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
        if self.graph != "qwen2_5_omni" and (self.mode != "omni" or "cb" in self.baselines):
            raise ValueError(f"--graph {self.graph} runs in omni mode with the hf baseline (text mode and cb are "
                             "Qwen2.5-Omni thinker comparisons)")
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

        if self.request_rate:
            cap = max(self.concurrency) if self.concurrency_given else None
            return [LoadPoint(concurrency=cap, request_rate=r) for r in self.request_rate]
        return [LoadPoint(concurrency=c) for c in self.concurrency]


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
                                   progress_every=cfg.progress_every, label=point.label(system)))
        run.system = system
        runs.append(run)
    return runs, notes


def _hf_run(cfg: BenchConfig, requests) -> RunResult:
    from omni_serve.bench.hf_baseline import HFBaselineConfig, run_hf_baseline

    return run_hf_baseline(requests, HFBaselineConfig(
        checkpoint=cfg.checkpoint, max_codec_tokens=cfg.max_codec_tokens, num_steps=cfg.num_steps,
        system_prompt=cfg.system_prompt, threads=cfg.threads, warmup=cfg.warmup,
        progress_every=cfg.progress_every), graph=cfg.graph)


def _cb_runs(cfg: BenchConfig, prompts: list[list[int]]) -> list[RunResult]:
    import torch

    from omni_serve.bench.cb_baseline import cb_cache_sizing, run_transformers_cb, thinker_causal_lm

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from transformers import AutoTokenizer

    model = thinker_causal_lm(cfg.checkpoint, attn_implementation=cfg.cb_attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(cfg.checkpoint)
    runs = []
    for point in cfg.points():
        cap = point.concurrency or len(prompts)
        sizing = cb_cache_sizing(prompts, cfg.max_tokens, cap, page_size=cfg.cb_page_size)
        log.info("cb run %s: %d requests ...", point.label("cb"), len(prompts))
        runs.append(run_transformers_cb(model, prompts, cfg.max_tokens, point.concurrency,
                                        request_rate=point.request_rate, arrival_seed=cfg.seed, sizing=sizing,
                                        warmup=cfg.warmup > 0, progress_every=cfg.progress_every,
                                        timeout_s=cfg.timeout_s, tokenizer=tokenizer,
                                        min_new_tokens=cfg.min_tokens))
    return runs


def _text_threads(cfg: BenchConfig) -> int:
    """The CPU threads of every text-mode system: ``threads``, else torch's default (set for this process)."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return torch.get_num_threads()


def _engine_text_runs(cfg: BenchConfig, prompts: list[list[int]], threads: int) -> list[RunResult]:
    from omni_serve.bench.engine_text import run_engine_text
    from omni_serve.bench.vllm_text import VllmTextError, resolve_vllm_python, run_vllm_text

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.checkpoint)
    python = resolve_vllm_python(cfg.vllm_python) if "vllm" in cfg.thinker_backends else None  # fail before running
    runs = []
    for backend in cfg.thinker_backends:
        for point in cfg.points():
            common = dict(request_rate=point.request_rate, arrival_seed=cfg.seed, progress_every=cfg.progress_every,
                          tokenizer=tokenizer, min_new_tokens=cfg.min_tokens, warmup=cfg.warmup > 0)
            if backend == "native":
                log.info("engine_text run %s ...", point.label("engine_text"))
                runs.append(run_engine_text(cfg.checkpoint, prompts, cfg.max_tokens, point.concurrency, **common))
                continue
            label = point.label("vllm")
            log.info("vllm run %s (vLLM in %s) ...", label, python)
            try:
                runs.append(run_vllm_text(cfg.checkpoint, prompts, cfg.max_tokens, point.concurrency, label=label,
                                          python=python, threads=threads, kv_cache_gib=cfg.vllm_kv_cache_gib,
                                          **common))
            except VllmTextError as exc:
                log.error("%s failed: %s", label, exc)
                runs.append(_failed_vllm_run(label, point, len(prompts), str(exc)))
    return runs


def _failed_vllm_run(label: str, point, n: int, error: str) -> RunResult:
    from omni_serve.bench.records import RequestRecord

    first = error.splitlines()[0] if error else "the vLLM run failed"
    return RunResult(label=label, system="vllm", mode="text", concurrency=point.concurrency,
                     request_rate=point.request_rate, records=[RequestRecord(index=i, error=first[:300])
                                                               for i in range(n)],
                     notes=[f"the vLLM subprocess failed: {error[-1500:]}"])


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


def run_bench(cfg: BenchConfig) -> BenchOutcome:
    from omni_kernels import kernel_paths

    from omni_serve.bench.machine import machine_info
    from omni_serve.bench.report import build_report, format_table, write_report

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
        if "hf" in cfg.baselines:
            runs.append(_hf_run(cfg, requests))
        if "cb" in cfg.baselines:
            from omni_serve.bench.cb_baseline import text_prompts

            runs += _cb_runs(cfg, text_prompts(cfg.checkpoint, requests, cfg.system_prompt))
    else:
        from omni_serve.bench.cb_baseline import text_prompts

        threads = _text_threads(cfg)
        extra["threads_used"] = threads
        prompts = text_prompts(cfg.checkpoint, requests, cfg.system_prompt)
        runs += _engine_text_runs(cfg, prompts, threads)
        extra["machine"]["stages"]["this process"] = kernel_paths()
        _calibration(cfg, extra, "baseline", notes)
        for system in cfg.baselines or ["cb"]:
            if system == "cb":
                runs += _cb_runs(cfg, prompts)
            elif system == "hf":
                runs.append(_hf_run(cfg, requests))
    config = {**cfg.model_dump(mode="json"), **extra}
    report = build_report(runs, config=config, notes=notes)
    json_path, png_path = write_report(report, runs, cfg.out)
    return BenchOutcome(report=report, json_path=json_path, png_path=png_path, table=format_table(report), runs=runs)
