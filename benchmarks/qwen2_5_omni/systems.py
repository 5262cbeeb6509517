"""The in-process systems of the Omni benches (``omni_serve.bench.runner.InProcessSystems``): what ``run_bench``
compares the endpoint with.

Contract: ``OmniSystems(hf=HFBaseline)`` gives ``run_bench``:

* ``baseline_runs("hf", ...)``: the family's transformers ``generate`` one request at a time (``hf_baseline``; the
  qwen3_omni bench passes its ``Qwen3HFBaseline``).
* ``baseline_runs("cb", ...)``: the thinker as a ``Qwen2ForCausalLM`` through transformers' continuous batching at
  every load point (``cb_baseline``), on ``prompts`` (text mode) or the requests' own token ids.
* ``text_prompts``: the requests' token-id prompts as the served ingress would prefill them (``cb_baseline``).
* ``text_engine_runs``: each of ``cfg.thinker_backends`` at every load point, in that order (``native``: omni_serve's
  ``AREngine`` in process, ``engine_text``; ``vllm``: vLLM's ``AsyncLLM`` in the vLLM environment's interpreter,
  ``vllm_text``; a failed vLLM subprocess becomes a run of failed requests).
"""

from __future__ import annotations

import logging

from omni_serve.bench.records import RunResult
from omni_serve.bench.runner import BenchConfig
from omni_serve.bench.workload import BenchRequest

log = logging.getLogger(__name__)


class OmniSystems:
    def __init__(self, hf=None):
        self.hf = hf  # the HFBaseline class (None: hf_baseline.HFBaseline)

    def baseline_runs(self, system: str, cfg: BenchConfig, requests: list[BenchRequest],
                      prompts: list[list[int]] | None = None) -> list[RunResult]:
        if system == "hf":
            return [_hf_run(cfg, requests, self.hf)]
        if system == "cb":
            return _cb_runs(cfg, prompts if prompts is not None else self.text_prompts(cfg, requests))
        raise ValueError(f"the {cfg.graph} bench has no baseline {system!r}")

    def text_prompts(self, cfg: BenchConfig, requests: list[BenchRequest]) -> list[list[int]]:
        from benchmarks.qwen2_5_omni.cb_baseline import text_prompts

        return text_prompts(cfg.checkpoint, requests, cfg.system_prompt)

    def text_engine_runs(self, cfg: BenchConfig, prompts: list[list[int]], threads: int) -> list[RunResult]:
        return _engine_text_runs(cfg, prompts, threads)


def _hf_run(cfg: BenchConfig, requests, baseline=None) -> RunResult:
    from benchmarks.qwen2_5_omni.hf_baseline import HFBaseline, HFBaselineConfig, run_hf_baseline

    return run_hf_baseline(requests, HFBaselineConfig(
        checkpoint=cfg.checkpoint, max_codec_tokens=cfg.max_codec_tokens, num_steps=cfg.num_steps,
        system_prompt=cfg.system_prompt, threads=cfg.threads, warmup=cfg.warmup,
        progress_every=cfg.progress_every), baseline=baseline or HFBaseline)


def _cb_runs(cfg: BenchConfig, prompts: list[list[int]]) -> list[RunResult]:
    import torch

    from benchmarks.qwen2_5_omni.cb_baseline import cb_cache_sizing, run_transformers_cb, thinker_causal_lm

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


def _engine_text_runs(cfg: BenchConfig, prompts: list[list[int]], threads: int) -> list[RunResult]:
    from benchmarks.qwen2_5_omni.engine_text import run_engine_text
    from benchmarks.qwen2_5_omni.vllm_text import VllmTextError, resolve_vllm_python, run_vllm_text

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


