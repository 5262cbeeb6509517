"""``POST /v1/completions`` on the served Qwen2.5-Omni graph: the thinker on a raw prompt, against transformers'
greedy ``generate``; choices (prompts x n) in flight at once, streamed and not; the official client; bad input."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.integration
MODEL = "qwen2.5-omni"
PROMPTS = ("The quick brown fox", "Once upon a time")
TOKENS = 12


@pytest.fixture(scope="module")
def greedy(omni_tiny_dir):
    """transformers' greedy thinker continuation of a raw prompt (token ids), as ``generate`` computes it."""
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(omni_tiny_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(omni_tiny_dir)

    def run(prompt: str | list[int]) -> list[int]:
        ids = tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
        x = torch.tensor([ids])
        with torch.no_grad():
            seq = model.thinker.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=TOKENS,
                                         do_sample=False)
        return seq[0, x.shape[1]:].tolist()

    run.tokenizer = tokenizer
    return run


def complete(http, **body):
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": TOKENS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_completion_is_greedy_generate_on_the_raw_prompt(http, greedy):
    """A string prompt (tokenized as given, no chat template) and the same prompt as token ids give transformers'
    greedy tokens; the text is their decode. Control: the other prompt's reference differs."""
    ids = greedy.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    for prompt in (PROMPTS[0], ids):
        body = complete(http, prompt=prompt, temperature=0, return_token_ids=True)
        (choice,) = body["choices"]
        want = greedy(prompt)
        got = choice["token_ids"]
        assert len(got) >= 4 and got == want[:len(got)], (got, want)
        assert choice["text"] == greedy.tokenizer.decode(got, skip_special_tokens=True)
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(got),
                                 "total_tokens": len(ids) + len(got)}
        assert choice["finish_reason"] == ("length" if len(got) == TOKENS else "stop")
    assert greedy(PROMPTS[1])[:len(got)] != got


def test_choices_run_at_once_and_each_equals_its_single_request(http, omni_app):
    """Two prompts x n=2, sampled: four choices indexed prompt x n + j; choice j samples with seed + j, so it
    equals the single request with that seed; the streamed choices (interleaved chunks) carry the same text,
    finish reasons and logprobs as the non-streamed reply."""
    from openai import OpenAI

    kw = dict(prompt=list(PROMPTS), n=2, temperature=1.0, seed=7, logprobs=2)
    body = complete(http, **kw, return_token_ids=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    single = complete(http, prompt=PROMPTS[1], temperature=1.0, seed=8, logprobs=2, return_token_ids=True)
    assert single["choices"][0]["token_ids"] == choices[3]["token_ids"]
    assert choices[2]["token_ids"] != choices[3]["token_ids"]  # seeds 7 and 8 sample differently
    for c in choices:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(c["token_ids"])
        assert all(len(top) <= 3 for top in lp["top_logprobs"])  # 2 alternatives and the sampled token
        assert all(tok in top for tok, top in zip(lp["tokens"], lp["top_logprobs"]))
        assert lp["text_offset"][0] == 0

    client = OpenAI(base_url=f"{omni_app}/v1", api_key="unused")
    stream = client.completions.create(model=MODEL, max_tokens=TOKENS, stream=True,
                                       stream_options={"include_usage": True}, **kw)
    text, logprobs, finish, usage = {}, {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            got = logprobs.setdefault(c.index, {"tokens": [], "token_logprobs": [], "text_offset": []})
            for key in got:
                got[key].extend(getattr(c.logprobs, key) if c.logprobs else [])
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in choices:
        i, want = c["index"], c["logprobs"]
        assert text[i] == c["text"] and finish[i] == c["finish_reason"]
        assert logprobs[i]["tokens"] == want["tokens"] and logprobs[i]["text_offset"] == want["text_offset"]
        assert logprobs[i]["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-5)
    assert usage.completion_tokens == body["usage"]["completion_tokens"]
    assert usage.prompt_tokens == body["usage"]["prompt_tokens"]


def test_the_official_client_and_echo(omni_app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{omni_app}/v1", api_key="unused")
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, echo=True)
    assert plain.object == "text_completion" and plain.usage.completion_tokens >= 1
    assert echoed.choices[0].text == PROMPTS[0] + plain.choices[0].text


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "x", "suffix": "y"}, "suffix", "no insertion mode"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of equal to n"),
    ({"prompt": [5, 99999999]}, "prompt", "outside the vocabulary"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"prompt": ["x", [5, 6]]}, "prompt", "a list of strings or a list of token-id lists"),
    ({"prompt": "x", "n": 17}, None, "at most 16"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, None, "echo with logprobs"),
    ({"prompt": "x", "max_tokens": 100000}, "prompt", "maximum context length"),
    ({"prompt": "x", "model": "nope"}, "model", "does not exist"),
    ({"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"prompt": [5, 3]}, "prompt", "media placeholder"),  # 3: the tiny checkpoint's audio placeholder
])
def test_bad_completion_requests_are_400s_naming_the_field(http, body, param, words):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
