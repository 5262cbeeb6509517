"""The Omni benches' baselines (benchmarks/) on the tiny checkpoint (no Ray): the thinker as a Qwen2ForCausalLM,
transformers' continuous batching, and the HF generate baseline."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from benchmarks.qwen2_5_omni.cb_baseline import (
    cb_cache_sizing, run_transformers_cb, text_prompts, thinker_causal_lm,
    thinker_text_config,
)
from benchmarks.qwen2_5_omni.engine_text import run_engine_text
from benchmarks.qwen2_5_omni.hf_baseline import HFBaseline, HFBaselineConfig, ServerDefaults
from omni_serve.bench.workload import WorkloadConfig, build_workload

MAX_NEW = 12


@pytest.fixture(scope="module")
def omni_ref(omni_tiny_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    return Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_tiny_dir, local_files_only=True).eval()


@pytest.fixture(scope="module")
def causal_lm(omni_tiny_dir):
    return thinker_causal_lm(omni_tiny_dir)


@pytest.fixture(scope="module")
def prompts(omni_tiny_dir):
    return text_prompts(omni_tiny_dir, build_workload(WorkloadConfig(num_requests=3, audio=False, max_words=12)))


def test_thinker_text_config_copies_the_decoder_sizes(omni_tiny_dir, omni_ref):
    cfg = thinker_text_config(omni_tiny_dir)
    tc = omni_ref.config.thinker_config.text_config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "hidden_act"):
        assert getattr(cfg, key) == getattr(tc, key), key
    assert cfg.rope_parameters["rope_theta"] == tc.rope_parameters["rope_theta"]
    assert cfg.rope_parameters["rope_type"] == "default"


def test_causal_lm_matches_the_omni_thinker(omni_tiny_dir, omni_ref, causal_lm, prompts):
    decoder = omni_ref.thinker.model
    decoder = getattr(decoder, "language_model", decoder)  # transformers 5 nests the text decoder
    thinker_params = dict(decoder.named_parameters())
    for name, p in causal_lm.model.named_parameters():
        assert torch.equal(p, thinker_params[name]), name
    assert torch.equal(causal_lm.lm_head.weight, omni_ref.thinker.lm_head.weight)
    for ids in prompts:
        x = torch.tensor([ids])
        mask = torch.ones_like(x)
        with torch.inference_mode():
            ref = omni_ref.generate(input_ids=x, attention_mask=mask, generation_mode="text",
                                    thinker_max_new_tokens=MAX_NEW, thinker_do_sample=False)
            out = causal_lm.generate(x, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False)
            ref_logits = omni_ref.thinker(input_ids=x, attention_mask=mask).logits
            logits = causal_lm(input_ids=x, attention_mask=mask).logits
        ref = getattr(ref, "sequences", ref)
        assert out[0, len(ids):].tolist() == ref[0, len(ids):].tolist()
        assert len(out[0]) > len(ids)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_transformers_cb_runs_every_prompt_greedily(omni_tiny_dir, causal_lm, prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(omni_tiny_dir)
    sizing = cb_cache_sizing(prompts, 5, concurrency=2, page_size=16)
    assert sizing.num_blocks >= 2 * -(-(max(map(len, prompts)) + 5) // 16)
    run = run_transformers_cb(causal_lm, prompts, 5, concurrency=2, sizing=sizing, progress_every=0, tokenizer=tok)
    assert run.system == "cb" and run.mode == "text" and run.concurrency == 2
    assert len(run.records) == 3 and run.num_errors == 0 and run.wall_s > 0
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for ids, rec in zip(prompts, run.records):
        assert rec.ok and 1 <= rec.output_tokens <= 5 and rec.token_source == "cb"
        assert rec.ttft_s is not None and rec.e2e_s >= rec.ttft_s
        assert len(rec.itl_s) == rec.output_tokens - 1
        with torch.inference_mode():
            ref = causal_lm.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
        text = tok.decode([t for t in ref if t != eos], skip_special_tokens=True)
        assert rec.output_tokens == len(ref)
        assert rec.text_sha1 == hashlib.sha1(text.encode()).hexdigest()
    assert "attn_implementation=sdpa" in run.notes[0]


def test_engine_text_side_matches_generate(omni_tiny_dir, prompts, causal_lm):
    """The engine's text run (in process, batched) returns greedy generate's tokens, with real timings."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(omni_tiny_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    run = run_engine_text(omni_tiny_dir, prompts, 5, 2, tokenizer=tok, progress_every=0)
    assert run.system == "engine_text" and run.num_errors == 0 and run.wall_s > 0
    for ids, rec in zip(prompts, run.records):
        with torch.inference_mode():
            ref = causal_lm.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)[0, len(ids):].tolist()
        text = tok.decode([t for t in ref if t != eos], skip_special_tokens=True)
        assert rec.output_tokens == len(ref) and len(rec.itl_s) == len(ref) - 1
        assert rec.text_sha1 == hashlib.sha1(text.encode()).hexdigest()


def test_hf_baseline_mirrors_the_server(omni_tiny_dir):
    from omni_serve.api import protocol as P
    from omni_serve.families.qwen2_5_omni.frontend import Qwen25OmniFrontend as OmniFrontend
    from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec

    base = HFBaseline(HFBaselineConfig(checkpoint=omni_tiny_dir, max_codec_tokens=16, num_steps=2, warmup=0,
                                       progress_every=0))
    reqs = build_workload(WorkloadConfig(num_requests=2, max_tokens=6, audio=True, voice="ethan"))
    # The ingress's message conversion gives the same chat as the baseline (default system prompt first).
    spec = OmniGraphSpec(checkpoint=omni_tiny_dir)
    server_msgs, *_ = OmniFrontend._convert_messages(
        SimpleNamespace(spec=spec, inputs=base.inputs, default_system_prompt=OmniFrontend.default_system_prompt),
        [P.ChatMessage(**m) for m in reqs[0].messages()])
    assert server_msgs == base.messages(reqs[0])

    kw = base.generate_kwargs(reqs[0])
    spec_defaults = ServerDefaults.from_spec()
    assert kw["speaker"] == "Ethan" and kw["thinker_do_sample"] is False and kw["talker_do_sample"] is False
    assert kw["thinker_max_new_tokens"] == 6 and kw["talker_max_new_tokens"] == 16
    assert kw["token2wav_num_steps"] == 2
    assert kw["talker_repetition_penalty"] == spec_defaults.talker_repetition_penalty
    assert kw["thinker_eos_token_id"] == base.im_end and "thinker_min_new_tokens" not in kw
    fixed = build_workload(WorkloadConfig(num_requests=1, max_tokens=6, min_tokens=6))[0]
    assert base.generate_kwargs(fixed)["thinker_min_new_tokens"] == 6
    sampled = base.generate_kwargs(build_workload(WorkloadConfig(num_requests=1, temperature=0.7))[0])
    assert sampled["thinker_do_sample"] and sampled["thinker_temperature"] == 0.7 and sampled["thinker_top_k"] == 0
    assert sampled["talker_temperature"] == spec_defaults.talker_temperature
    assert sampled["talker_top_k"] == spec_defaults.talker_top_k

    text_req = build_workload(WorkloadConfig(num_requests=1, max_tokens=6, audio=False))[0]
    run = base.run(reqs + [text_req])
    assert run.system == "hf" and not run.streaming and run.concurrency == 1
    assert len(run.records) == 3 and run.num_errors == 0
    for rec, req in zip(run.records, reqs + [text_req]):
        assert 1 <= rec.output_tokens <= 6 and rec.token_source == "generate"
        assert rec.ttft_s == rec.e2e_s
        if req.audio:
            assert rec.ttfp_s == rec.e2e_s and rec.audio_seconds > 0
        else:
            assert rec.ttfp_s is None and rec.audio_seconds == 0
    assert any("TTFT = TTFP = E2E" in n for n in run.notes)


def test_hf_baseline_records_failures(omni_tiny_dir):
    base = HFBaseline(HFBaselineConfig(checkpoint=omni_tiny_dir, max_codec_tokens=8, num_steps=1, warmup=0,
                                       progress_every=0))
    bad = build_workload(WorkloadConfig(num_requests=1, max_tokens=4, audio=True, voice="Nobody"))
    run = base.run(bad)
    assert run.num_errors == 1 and "unknown voice" in run.records[0].error


def test_cb_fixed_length_suppresses_the_stop_token_like_generate(omni_tiny_dir, causal_lm, prompts):
    """min_new_tokens == max_new_tokens: CB output equals generate(min_new_tokens=max_new_tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(omni_tiny_dir)
    with torch.inference_mode():
        natural = causal_lm.generate(torch.tensor([prompts[0]]), max_new_tokens=MAX_NEW, do_sample=False)
    stop = natural[0, len(prompts[0]) + 2].item()  # a token greedy decoding emits early: make it the stop token
    ended = run_transformers_cb(causal_lm, prompts, MAX_NEW, 2, eos_token_id=stop, progress_every=0)
    assert ended.records[0].output_tokens == 3 and ended.records[0].finish_reason == "stop"
    fixed = run_transformers_cb(causal_lm, prompts, MAX_NEW, 2, eos_token_id=stop, min_new_tokens=MAX_NEW,
                                progress_every=0, tokenizer=tok)
    for ids, rec in zip(prompts, fixed.records):
        with torch.inference_mode():
            ref = causal_lm.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                     eos_token_id=stop, do_sample=False)[0, len(ids):].tolist()
        assert rec.ok and rec.output_tokens == len(ref) == MAX_NEW and stop not in ref
        assert rec.text_sha1 == hashlib.sha1(tok.decode(ref, skip_special_tokens=True).encode()).hexdigest()
    with pytest.raises(ValueError, match="min_new_tokens == max_new_tokens"):
        run_transformers_cb(causal_lm, prompts, MAX_NEW, 2, min_new_tokens=3)


def test_qwen3_hf_baseline_mirrors_the_qwen3_server(qwen3_omni_tiny_dir):
    """The qwen3_omni graph's baseline: its frontend's chat, its talker defaults, and a spoken answer whose text
    is the served graph's (the same greedy generate the oracle tests hold the graph to)."""
    from omni_serve.api import protocol as P
    from benchmarks.qwen3_omni.hf_baseline import Qwen3HFBaseline
    from omni_serve.families.qwen3_omni.frontend import Qwen3OmniFrontend
    from omni_serve.families.qwen3_omni.params import TalkerParams
    from omni_serve.families.qwen3_omni.spec import Qwen3OmniGraphSpec

    base = Qwen3HFBaseline(HFBaselineConfig(checkpoint=qwen3_omni_tiny_dir, max_codec_tokens=10, warmup=0,
                                            progress_every=0))
    reqs = build_workload(WorkloadConfig(num_requests=2, max_tokens=6, audio=True, voice="Ethan"))
    spec = Qwen3OmniGraphSpec(checkpoint=qwen3_omni_tiny_dir)
    frontend = SimpleNamespace(spec=spec, inputs=base.inputs, default_system_prompt=Qwen3OmniFrontend.default_system_prompt)
    server_msgs, *_ = Qwen3OmniFrontend._convert_messages(frontend, [P.ChatMessage(**m) for m in reqs[0].messages()])
    assert server_msgs == base.messages(reqs[0])
    kw = base.generate_kwargs(reqs[0])
    assert kw["speaker"] == "ethan" and kw["talker_max_new_tokens"] == 10 and kw["talker_do_sample"] is False
    assert kw["talker_repetition_penalty"] == TalkerParams().repetition_penalty and "token2wav_num_steps" not in kw
    run = base.run(reqs)
    assert run.num_errors == 0 and all(r.audio_seconds > 0 and r.output_tokens >= 1 for r in run.records)
    assert "Qwen3OmniMoeForConditionalGeneration" in run.notes[0]
