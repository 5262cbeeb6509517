"""Text-only comparison: the Omni thinker as a plain ``Qwen2ForCausalLM`` under transformers' continuous batching.

Contract:

* ``thinker_causal_lm(checkpoint_dir)`` -> ``transformers.Qwen2ForCausalLM`` with the Omni checkpoint's
  ``thinker_config.text_config`` sizes (hidden, layers, heads, kv heads, intermediate, vocab, rope theta,
  RMS eps, activation) and its ``thinker.model.*`` / ``thinker.lm_head.*`` weights (loaded strictly). It
  uses plain RoPE: for text-only input the three M-RoPE position rows are equal, so M-RoPE is plain RoPE,
  and greedy ``generate`` gives the same tokens as the Omni thinker (tested).
* ``run_transformers_cb(model, prompts, max_new_tokens, concurrency=...)`` runs token-id prompts through
  transformers' ``ContinuousBatchingManager`` (``model.init_continuous_batching``), greedy, stopping on
  ``eos_token_id`` (default: the checkpoint's ``<|im_end|>``, the server's stop token), with at most
  ``concurrency`` requests submitted and unfinished at a time (closed loop) or Poisson arrivals at
  ``request_rate`` (open loop, ``concurrency`` then caps requests in flight). The paged KV cache is sized
  explicitly by ``cb_cache_sizing`` (transformers' default sizes it from system RAM: gigabytes).
  ``min_new_tokens == max_new_tokens`` suppresses the stop token (fixed output lengths, as ``generate``
  with that ``min_new_tokens``); other positive values are rejected (transformers' CB drops the
  min-new-tokens logits processor). It returns a
  ``RunResult`` (``system="cb"``, ``mode="text"``) with per-request TTFT / ITL / E2E from per-token
  timestamps and exact output token counts (with ``tokenizer``, also the digest of the decoded text, as
  the server would return it). Every prompt yields one record (failures included).
* The engine side of the same comparison, with the same arguments and result shape, is
  ``benchmarks.qwen2_5_omni.engine_text.run_engine_text``.
* ``text_prompts(checkpoint_dir, requests)`` turns workload requests into the exact token ids the server's
  ingress builds (default system prompt + user turn, chat template).

CPU attention: ``attn_implementation="sdpa"`` and ``"paged|eager"`` both work with continuous batching on
CPU in transformers 5.23 (``"paged|sdpa"`` is deprecated: the ``paged|`` prefix is only kept for eager).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from omni_serve.bench.records import RequestRecord, RunResult

log = logging.getLogger(__name__)

CB_ATTN_IMPLEMENTATION = "sdpa"
THINKER_PREFIXES = {"thinker.model.": "model.", "thinker.lm_head.": "lm_head."}


def thinker_text_config(checkpoint_dir: str):
    """A ``Qwen2Config`` equal to the Omni thinker's text decoder, with plain RoPE."""
    from transformers import Qwen2Config

    from omni_serve.models.qwen2_5_omni_layout import load_config

    omni = load_config(checkpoint_dir)
    tc = omni.thinker_config.text_config
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(tc, "rope_theta", 10000.0))
    if rope.get("rope_type", "default") not in ("default", "mrope"):
        raise ValueError(f"thinker rope_type {rope.get('rope_type')!r} is not plain (M-)RoPE")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if head_dim != tc.hidden_size // tc.num_attention_heads:
        raise ValueError("Qwen2 derives head_dim = hidden_size / num_attention_heads; this thinker differs")
    return Qwen2Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=tc.intermediate_size,
        num_hidden_layers=tc.num_hidden_layers, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, hidden_act=tc.hidden_act,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
        use_sliding_window=False, attention_dropout=0.0,
        bos_token_id=None, eos_token_id=getattr(tc, "eos_token_id", None), pad_token_id=getattr(tc, "pad_token_id", 0),
    )


def thinker_causal_lm(checkpoint_dir: str, dtype=None, attn_implementation: str = CB_ATTN_IMPLEMENTATION):
    """The Omni thinker's text decoder as a ``Qwen2ForCausalLM`` (weights from the checkpoint's safetensors)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    from omni_serve.models.loading import load_component

    cfg = thinker_text_config(checkpoint_dir)
    cfg._attn_implementation = attn_implementation
    model = load_component(checkpoint_dir, Qwen2ForCausalLM, cfg, THINKER_PREFIXES, dtype or torch.float32)
    model.set_attn_implementation(attn_implementation)
    eos = _im_end(checkpoint_dir)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=cfg.pad_token_id, do_sample=False)
    return model


def _im_end(checkpoint_dir: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir).convert_tokens_to_ids("<|im_end|>")


def text_prompts(checkpoint_dir: str, requests, system_prompt: str | None = None) -> list[list[int]]:
    """Token ids of each workload request exactly as the server's ingress tokenizes it."""
    from omni_serve.families.qwen2_5_omni.spec import SPEECH_SYSTEM_PROMPT
    from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor

    proc = OmniInputProcessor(checkpoint_dir)
    sys_msg = {"role": "system", "content": [{"type": "text", "text": system_prompt or SPEECH_SYSTEM_PROMPT}]}
    return [proc([sys_msg, {"role": "user", "content": [{"type": "text", "text": r.prompt}]}]).input_ids[0].tolist()
            for r in requests]


@dataclass
class CBCacheSizing:
    page_size: int
    num_blocks: int
    max_batch_tokens: int
    max_requests_per_batch: int


def cb_cache_sizing(prompts: list[list[int]], max_new_tokens: int, concurrency: int,
                    page_size: int = 32, max_batch_tokens: int | None = None) -> CBCacheSizing:
    """Enough blocks for ``concurrency`` of the longest requests (prompt + output), plus one spare per slot."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    per_request = math.ceil(longest / page_size) + 1
    slots = max(1, min(concurrency, len(prompts)))
    mbt = max_batch_tokens or max(256, min(4096, max(len(p) for p in prompts) + slots))
    return CBCacheSizing(page_size=page_size, num_blocks=slots * per_request, max_batch_tokens=mbt,
                         max_requests_per_batch=slots)


def cb_config(sizing: CBCacheSizing, **extra: Any):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    return ContinuousBatchingConfig(
        page_size=sizing.page_size, num_blocks=sizing.num_blocks, max_batch_tokens=sizing.max_batch_tokens,
        max_requests_per_batch=sizing.max_requests_per_batch, auto_switch_to_flash=False,
        allow_block_sharing=False, use_cuda_graph=False, **extra)


def run_transformers_cb(model, prompts: list[list[int]], max_new_tokens: int, concurrency: int | None = 1, *,
                        request_rate: float | None = None, arrival_seed: int = 0, eos_token_id: int | None = None,
                        sizing: CBCacheSizing | None = None, warmup: bool = True, progress_every: int = 10,
                        label: str | None = None, timeout_s: float = 3600.0, tokenizer=None,
                        min_new_tokens: int = 0) -> RunResult:
    """Greedy continuous-batching generation of ``prompts``; at most ``concurrency`` unfinished at a time."""
    import torch
    from transformers import GenerationConfig

    from omni_serve.bench.client import LoadPoint, poisson_arrivals, progress_logger

    if not prompts:
        raise ValueError("no prompts")
    point = LoadPoint(concurrency=concurrency, request_rate=request_rate)
    label = label or point.label("cb")
    cap = concurrency or len(prompts)
    sizing = sizing or cb_cache_sizing(prompts, max_new_tokens, cap)
    eos = eos_token_id if eos_token_id is not None else model.generation_config.eos_token_id
    suppress = None
    if min_new_tokens >= max_new_tokens:
        # Fixed output length, as min_new_tokens == max_new_tokens means for generate: the stop token is
        # never chosen (suppressed) and so never ends a request.
        suppress, eos = ([eos] if isinstance(eos, int) else list(eos)), -1
    elif min_new_tokens > 0:
        raise ValueError("transformers' continuous batching drops MinNewTokensLengthLogitsProcessor: only "
                         "min_new_tokens == max_new_tokens (stop token suppressed) is supported")
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                               pad_token_id=model.generation_config.pad_token_id, suppress_tokens=suppress)
    arrivals = poisson_arrivals(len(prompts), request_rate, arrival_seed) if request_rate else [0.0] * len(prompts)
    records = [RequestRecord(index=i) for i in range(len(prompts))]
    submit_t: dict[str, float] = {}
    on_done = progress_logger(label, len(prompts), progress_every)

    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_config(sizing))
    if warmup:
        manager.warmup()
    manager.start()
    try:
        if warmup:  # one unmeasured request through the whole loop
            manager.add_request(prompts[0], request_id="warmup", max_new_tokens=min(2, max_new_tokens))
            _wait(manager, {"warmup"}, timeout_s)
        t_run = time.perf_counter()
        nxt, in_flight, finished = 0, {}, 0
        deadline = t_run + timeout_s
        while finished < len(prompts):
            now = time.perf_counter()
            while nxt < len(prompts) and len(in_flight) < cap and t_run + arrivals[nxt] <= now:
                rid = f"bench_{nxt}"
                submit_t[rid] = time.perf_counter()
                records[nxt].start_s = submit_t[rid] - t_run
                manager.add_request(prompts[nxt], request_id=rid, max_new_tokens=max_new_tokens,
                                    record_timestamps=True, eos_token_id=eos)
                in_flight[rid] = nxt
                nxt += 1
            wait = 0.05
            if nxt < len(prompts) and len(in_flight) < cap:
                wait = max(0.0, min(wait, t_run + arrivals[nxt] - time.perf_counter()))
            if not in_flight:
                time.sleep(wait)
                continue
            result = manager.get_result(timeout=wait)
            if result is not None and result.is_finished() and result.request_id in in_flight:
                i = in_flight.pop(result.request_id)
                _fill(records[i], result, submit_t[result.request_id], eos, tokenizer)
                finished += 1
                on_done(records[i])
            elif in_flight and not manager.is_running():
                for i in in_flight.values():
                    records[i].error = "continuous batching loop stopped before the request finished"
                finished += len(in_flight)
                in_flight.clear()
                if nxt < len(prompts):
                    for i in range(nxt, len(prompts)):
                        records[i].error = "not run: continuous batching loop stopped"
                    finished += len(prompts) - nxt
                    nxt = len(prompts)
            if time.perf_counter() > deadline:
                for i in in_flight.values():
                    records[i].error = f"timeout after {timeout_s}s"
                for i in range(nxt, len(prompts)):
                    records[i].error = f"not run: timeout after {timeout_s}s"
                break
        wall = time.perf_counter() - t_run
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    attn = model.config._attn_implementation
    notes = [f"transformers continuous batching, greedy, attn_implementation={attn}, {torch.get_num_threads()} "
             f"torch threads; cache: page_size={sizing.page_size}, num_blocks={sizing.num_blocks}, "
             f"max_batch_tokens={sizing.max_batch_tokens}, max_requests_per_batch={sizing.max_requests_per_batch}"]
    return RunResult(label=label, system="cb", mode="text", concurrency=concurrency, request_rate=request_rate,
                     wall_s=wall, streaming=True, records=records, notes=notes)


def _wait(manager, ids: set[str], timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    while ids and time.perf_counter() < deadline:
        r = manager.get_result(timeout=0.1)
        if r is not None and r.is_finished():
            ids.discard(r.request_id)
        elif r is None and not manager.is_running():
            raise RuntimeError("continuous batching loop stopped during warm-up")


def _fill(rec: RequestRecord, result, t_submit: float, eos, tokenizer=None) -> None:
    t_end = time.perf_counter()
    if result.error is not None:
        rec.error = f"generation failed: {result.error}"[:300]
        rec.e2e_s = t_end - t_submit
        return
    tokens = list(result.generated_tokens)
    stamps = list(result.timestamps or [])
    rec.ok = True
    rec.output_tokens, rec.token_source = len(tokens), "cb"
    eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    rec.finish_reason = "stop" if tokens and tokens[-1] in eos_ids else "length"
    rec.text_deltas = len(tokens)
    if tokenizer is not None:  # the text the server would return, for parity checks (text_sha1)
        text = tokenizer.decode([t for t in tokens if t not in eos_ids], skip_special_tokens=True)
        rec.text_chars, rec.text_sha1 = len(text), hashlib.sha1(text.encode("utf-8")).hexdigest()
    if stamps:
        rec.ttft_s = stamps[0] - t_submit
        rec.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
        rec.e2e_s = stamps[-1] - t_submit
    else:
        rec.e2e_s = t_end - t_submit
