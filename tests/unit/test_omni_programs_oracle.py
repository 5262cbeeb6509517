"""The stages on their real engines, wired in-process, reproduce transformers' Qwen2.5-Omni generate exactly.

No Ray: engines, programs and models as served; edges are asyncio queues (see tests/omni_inprocess.py).
Both thinker layouts (aggregated, and prefill -> decode disaggregated) are held to the same oracle.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from omni_serve.engines.ar import ARConfig
from omni_serve.models.qwen2_5_omni import OmniCode2Wav, OmniEncoder, OmniTalker, OmniThinker
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from tests.omni_cases import ALL_CASES, CASES, reference_inputs, serve_inputs
from tests.omni_inprocess import InProcessOmni

THINKER_TOKENS, TALKER_TOKENS, STEPS, SEED = 12, 20, 3, 7


@pytest.fixture(scope="module")
def models(omni_tiny_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration

    d = omni_tiny_dir
    ref = Qwen2_5OmniForConditionalGeneration.from_pretrained(d).eval()
    return ref, OmniInputProcessor(d), OmniEncoder(d), OmniThinker(d), OmniTalker(d), OmniCode2Wav(d)


def reference(ref, inputs):
    codes = []
    hook = ref.token2wav.register_forward_pre_hook(lambda m, a: codes.append(a[0][0].tolist()))
    try:
        torch.manual_seed(SEED)
        seq, wav = ref.generate(**inputs.reference_kwargs(), thinker_max_new_tokens=THINKER_TOKENS,
                                talker_max_new_tokens=TALKER_TOKENS, thinker_do_sample=False,
                                talker_do_sample=False, token2wav_num_steps=STEPS)
    finally:
        hook.remove()
    return seq[0, inputs.input_ids.shape[1]:].tolist(), codes[0], wav.numpy()


def run(coro):
    return asyncio.run(coro)


def check(result, ref, samples_per_code):
    ref_tokens, ref_codes, ref_wav = ref
    assert result.tokens == ref_tokens
    assert result.codes == ref_codes
    assert result.wav.shape == ref_wav.shape == (len(result.codes) * samples_per_code,)
    # Streamed chunk by chunk, the audio equals transformers' whole-sequence code2wav (random weights make
    # it quiet, so the tolerance is relative to its peak).
    np.testing.assert_allclose(result.wav, ref_wav, rtol=0, atol=1e-4 * np.abs(ref_wav).max())


@pytest.fixture(scope="module")
def references(models, omni_tiny_dir):
    """Per case: the served inputs (ours) and generate's output on transformers' processor's inputs."""
    ref, proc = models[0], models[1]
    inputs = {kind: serve_inputs(proc, kind) for kind in ALL_CASES}
    return inputs, {kind: reference(ref, reference_inputs(omni_tiny_dir, kind)) for kind in ALL_CASES}


LAYOUTS = ("aggregated", "disaggregated")


async def _serve(checkpoint, ar, jobs, layout="aggregated"):
    omni = InProcessOmni(checkpoint, ar, steps=STEPS, talker_tokens=TALKER_TOKENS, thinker_layout=layout)
    try:
        results = await asyncio.gather(*(omni.run(f"r{i}", x, THINKER_TOKENS, SEED) for i, x in enumerate(jobs)))
        stats = (omni.thinker.stats(), omni.talker.stats())
        if omni.thinker_prefill is not None:
            stats += (omni.thinker_prefill.stats(),)
    finally:
        await omni.close()
    return results, stats


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ALL_CASES)
def test_stages_match_transformers_generate(models, references, omni_tiny_dir, kind, layout):
    inputs, refs = references
    (result,), stats = run(_serve(omni_tiny_dir, ARConfig(), [inputs[kind]], layout))
    check(result, refs[kind], models[-1].samples_per_code)
    if layout == "disaggregated":  # decode computed only the generated tokens' rows: the prompt came as KV
        decode, _, prefill = stats
        assert prefill["batched_rows"] == inputs[kind].input_ids.shape[1]
        assert decode["batched_rows"] == len(result.tokens) - 1


def test_prompts_differ_so_outputs_differ(references):
    """Negative control: the oracle can fail (each case's reference differs from every other's, the video heard
    with and without its sound track included)."""
    _, refs = references
    for a in ALL_CASES:
        for b in ALL_CASES:
            if a != b:
                assert refs[a][0] != refs[b][0] and refs[a][1] != refs[b][1], (a, b)


def test_eight_in_flight_match_batch_of_one(models, references, omni_tiny_dir):
    """Continuous batching: 8 concurrent requests (mixed media) decode exactly as each does alone."""
    inputs, refs = references
    kinds = [ALL_CASES[i % len(ALL_CASES)] for i in range(8)]
    results, (thinker, talker) = run(_serve(omni_tiny_dir, ARConfig(), [inputs[k] for k in kinds]))
    for kind, result in zip(kinds, results):
        check(result, refs[kind], models[-1].samples_per_code)
    assert thinker["batched_rows"] > thinker["steps"], "requests were never batched together"
    assert talker["kv_blocks_used"] == thinker["kv_blocks_used"] == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_pressure_queues_and_preempts_without_loss(models, references, omni_tiny_dir, layout):
    """A cache far smaller than 8 requests need: all complete exactly, blocks all come back."""
    inputs, refs = references
    kinds = [CASES[i % len(CASES)] for i in range(8)]
    ar = ARConfig(num_kv_blocks=24, block_size=4, max_batch_tokens=32)
    longest = max(inputs[k].input_ids.shape[1] for k in kinds) + THINKER_TOKENS + 2 + TALKER_TOKENS
    assert 8 * longest > ar.num_kv_blocks * ar.block_size  # the pressure is real
    results, engines = run(_serve(omni_tiny_dir, ar, [inputs[k] for k in kinds], layout))
    for kind, result in zip(kinds, results):
        check(result, refs[kind], models[-1].samples_per_code)
    assert engines[0]["preemptions"] + engines[1]["preemptions"] > 0
    for stats in engines:
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == ar.num_kv_blocks


def test_video_prompts_under_kv_pressure_preempt_without_loss(models, references, omni_tiny_dir):
    """Video prompts (hundreds of rows) beside the other kinds in a cache that holds about one of them."""
    inputs, refs = references
    kinds = [ALL_CASES[(i + 3) % len(ALL_CASES)] for i in range(8)]
    ar = ARConfig(num_kv_blocks=100, block_size=4, max_batch_tokens=64)
    longest = max(inputs[k].input_ids.shape[1] for k in kinds) + THINKER_TOKENS + 2 + TALKER_TOKENS
    assert longest < ar.num_kv_blocks * ar.block_size < 2 * longest  # one fits, two of the largest do not
    results, engines = run(_serve(omni_tiny_dir, ar, [inputs[k] for k in kinds]))
    for kind, result in zip(kinds, results):
        check(result, refs[kind], models[-1].samples_per_code)
    assert engines[0]["preemptions"] + engines[1]["preemptions"] > 0
    for stats in engines:
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == ar.num_kv_blocks


def test_each_adapter_holds_only_its_component(models):
    _, _, enc, thk, tlk, c2w = models
    def names(adapter):
        return {n for m in adapter.modules.values() for n, _ in m.named_parameters()}
    assert not any("audio" in n or "visual" in n or "blocks" in n for n in names(thk))
    # "layers." / "norm": the talker's decoder layers, prepared (omni_serve.models.prepared_decoder)
    assert all(n.startswith(("model.", "thinker_to_talker_proj", "codec_head", "layers.", "norm")) for n in names(tlk))
    assert any(n.startswith("code2wav_dit_model") for n in names(c2w))
    held = {id(p): p for a in (enc, thk, tlk, c2w) for m in a.modules.values() for p in m.parameters()}
    total = sum(p.numel() for p in held.values())  # a parameter two of an adapter's modules share counts once
    ref = models[0]
    assert total == sum(p.numel() for p in ref.parameters())


def test_a_one_token_reply_gives_its_text_and_empty_audio(references, omni_tiny_dir):
    """A thinker reply of one token (max_tokens=1, or an immediate stop) leaves the talker no reply state to
    speak from: the request ends with the token and zero audio samples, and every stage frees its blocks."""
    inputs, _ = references

    async def go():
        omni = InProcessOmni(omni_tiny_dir, ARConfig(), steps=STEPS, talker_tokens=TALKER_TOKENS)
        try:
            result = await asyncio.wait_for(omni.run("one", inputs["text"], 1, SEED), 60)
            return result, omni.thinker.stats(), omni.talker.stats(), omni.talker.num_active
        finally:
            await omni.close()

    result, thinker, talker, talker_active = run(go())
    assert len(result.tokens) == 1
    assert result.codes == []
    assert result.wav is not None and result.wav.shape == (0,)
    assert talker["steps"] == 0 and talker["kv_blocks_used"] == thinker["kv_blocks_used"] == 0
    assert talker_active == 0


def test_presence_and_frequency_penalties_equal_generate_with_openais_formula(models, references, omni_tiny_dir):
    """The thinker's penalties (OpenAI's: a token's logit less frequency x its count among the tokens generated so
    far, less presence once it occurred) and logit_bias equal transformers' greedy ``generate`` with that formula as
    a logits processor after its own SequenceBiasLogitsProcessor; and they change the reply (controls: the reply
    without the bias, and the one without any penalty, differ)."""
    from transformers import LogitsProcessor, LogitsProcessorList
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    class Penalties(LogitsProcessor):
        def __init__(self, prompt: int, presence: float, frequency: float):
            self.prompt, self.presence, self.frequency = prompt, presence, frequency

        def __call__(self, input_ids, scores):
            generated = input_ids[:, self.prompt:]
            counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
            return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)

    ref, inputs, refs = models[0], references[0], references[1]
    kwargs = reference_inputs(omni_tiny_dir, "text").reference_kwargs()
    prompt = kwargs["input_ids"].shape[1]

    def reference(*processors) -> list[int]:
        with torch.no_grad():
            seq = ref.thinker.generate(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"],
                                       max_new_tokens=THINKER_TOKENS, do_sample=False,
                                       logits_processor=LogitsProcessorList(list(processors)))
        return seq[0, prompt:].tolist()

    presence, frequency = 0.5, 1.5
    unbiased = reference(Penalties(prompt, presence, frequency))
    bias = [(unbiased[1], -100.0), (5, 1.5)]  # rules out the penalized reply's second token
    expected = reference(SequenceBiasLogitsProcessor({(t,): v for t, v in bias}), Penalties(prompt, presence, frequency))
    assert expected[:2] != unbiased[:2]
    penalties = {"presence_penalty": presence, "frequency_penalty": frequency, "logit_bias": bias}

    async def serve_one():
        omni = InProcessOmni(omni_tiny_dir, ARConfig(), steps=STEPS, talker_tokens=TALKER_TOKENS)
        try:
            return await omni.run("p", inputs["text"], THINKER_TOKENS, SEED, audio=False, penalties=penalties)
        finally:
            await omni.close()
    served = run(serve_one())
    assert served.tokens == expected[:len(served.tokens)] and len(served.tokens) >= 4, (served.tokens, expected)
    assert served.tokens != refs["text"][0][:len(served.tokens)]  # the penalties changed the reply


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_equal_the_log_softmax_of_generates_logits(models, omni_tiny_dir, layout):
    """Each text token's logprob and its top alternatives are the log-softmax of the logits transformers' greedy
    ``generate`` computed at that step (raw: before any processor), to 1e-4; one entry per token, the end token
    included; disaggregated, the first comes from the logits prefill handed over. Control: the same comparison one
    step off misses by far more than the tolerance."""
    ref, top = models[0], 5
    x = serve_inputs(models[1], "text")

    async def serve_one():
        omni = InProcessOmni(omni_tiny_dir, ARConfig(), steps=STEPS, talker_tokens=TALKER_TOKENS,
                             thinker_layout=layout)
        try:
            return await omni.run("lp", x, THINKER_TOKENS, SEED, audio=False, logprobs=top)
        finally:
            await omni.close()
    served = run(serve_one())
    kwargs = reference_inputs(omni_tiny_dir, "text").reference_kwargs()
    with torch.no_grad():
        out = ref.thinker.generate(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"],
                                   max_new_tokens=THINKER_TOKENS, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
    want = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    assert len(served.tokens) >= 4 and len(served.logprobs) == len(served.tokens)
    assert served.tokens == out.sequences[0, kwargs["input_ids"].shape[1]:].tolist()[:len(served.tokens)]
    for i, (token, lp) in enumerate(zip(served.tokens, served.logprobs)):
        assert abs(lp.logprob - float(want[i][token])) < 1e-4, (i, lp.logprob, float(want[i][token]))
        values, ids = want[i].topk(top)
        assert [t for t, _ in lp.top] == ids.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], values.numpy(), atol=1e-4)
        assert lp.top[0][0] == token  # greedy: the chosen token is the most likely one
    off = max(abs(lp.logprob - float(want[i + 1][token]))
              for i, (token, lp) in enumerate(zip(served.tokens[:-1], served.logprobs[:-1])))
    assert off > 1e-3, off


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_json_schema_constrained_reply_equals_generate_with_the_grammars_mask(models, omni_tiny_dir, layout):
    """With a JSON schema, the thinker's greedy reply is transformers' greedy ``generate`` with llguidance's mask for
    that schema as a logits processor (the library driven directly), token for token: JSON the schema accepts,
    then the end token. Control: unconstrained, the reply is not JSON."""
    import json

    import jsonschema
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    tokenizer = AutoTokenizer.from_pretrained(omni_tiny_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    x = serve_inputs(models[1], "text")

    async def serve_one():
        omni = InProcessOmni(omni_tiny_dir, ARConfig(), steps=STEPS, talker_tokens=TALKER_TOKENS,
                             thinker_layout=layout)
        try:
            return await omni.run("js", x, 40, SEED, audio=False, json_schema=json.dumps(schema))
        finally:
            await omni.close()
    served = run(serve_one())

    grammar = LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    seq, prompt = _generate_with_grammar(models, omni_tiny_dir, tokenizer, grammar, 40)
    assert served.tokens == seq[0, prompt:].tolist()
    assert served.tokens[-1] == end
    jsonschema.validate(json.loads(tokenizer.decode(served.tokens[:-1])), schema)
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode([t for t in references_free_reply(models, omni_tiny_dir) if t != end]))


def _generate_with_grammar(models, omni_tiny_dir, tokenizer, grammar: str, max_new: int):
    """transformers' greedy ``generate`` on the text prompt with llguidance's mask for ``grammar`` as a logits
    processor: (sequence, prompt length)."""
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import LogitsProcessor, LogitsProcessorList

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    vocab = models[0].thinker.config.text_config.vocab_size
    matcher = LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=end), grammar)

    class Grammar(LogitsProcessor):
        def __init__(self, prompt: int):
            self.prompt = prompt

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > self.prompt:
                assert matcher.consume_token(int(input_ids[0, -1]))
            bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[:vocab]
            return scores.masked_fill(bias == 0, -float("inf"))

    kwargs = reference_inputs(omni_tiny_dir, "text").reference_kwargs()
    prompt = kwargs["input_ids"].shape[1]
    with torch.no_grad():
        seq = models[0].thinker.generate(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"],
                                         max_new_tokens=max_new, do_sample=False, eos_token_id=end,
                                         logits_processor=LogitsProcessorList([Grammar(prompt)]))
    return seq, prompt


def test_a_forced_tool_call_equals_generate_with_the_grammars_mask(models, omni_tiny_dir):
    """With a named tool_choice, the thinker's greedy reply is transformers' greedy ``generate`` under llguidance's mask
    for the call's grammar (``api.tools.tool_call_grammar``), token for token, and it parses as a call of that function
    whose arguments the schema accepts. Control: unconstrained, the reply holds no call."""
    import json

    import jsonschema
    from transformers import AutoTokenizer

    from omni_serve.api.tools import ChatTool, NamedToolChoice, parse_tool_calls, tool_call_grammar

    params = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2]}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [ChatTool(type="function", function={"name": "get_weather", "parameters": params}),
             ChatTool(type="function", function={"name": "get_time"})]
    grammar = tool_call_grammar(tools, NamedToolChoice(type="function", function={"name": "get_weather"}), False)
    tokenizer = AutoTokenizer.from_pretrained(omni_tiny_dir)
    x = serve_inputs(models[1], "text")

    async def serve_one():
        omni = InProcessOmni(omni_tiny_dir, ARConfig(), steps=STEPS, talker_tokens=TALKER_TOKENS)
        try:
            return await omni.run("tool", x, 96, SEED, audio=False, grammar=grammar)
        finally:
            await omni.close()
    served = run(serve_one())
    seq, prompt = _generate_with_grammar(models, omni_tiny_dir, tokenizer, grammar, 96)
    assert served.tokens == seq[0, prompt:].tolist()
    assert served.tokens[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    content, calls = parse_tool_calls(tokenizer.decode(served.tokens[:-1]))
    assert content is None and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), params)
    assert parse_tool_calls(tokenizer.decode(references_free_reply(models, omni_tiny_dir)))[1] == []


def references_free_reply(models, omni_tiny_dir) -> list[int]:
    """The thinker's unconstrained greedy reply to the same prompt (transformers' generate)."""
    kwargs = reference_inputs(omni_tiny_dir, "text").reference_kwargs()
    with torch.no_grad():
        seq = models[0].thinker.generate(input_ids=kwargs["input_ids"], attention_mask=kwargs["attention_mask"],
                                         max_new_tokens=40, do_sample=False)
    return seq[0, kwargs["input_ids"].shape[1]:].tolist()
