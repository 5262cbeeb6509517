"""/v1/completions' request and response models: what the official client sends parses, what we answer it reads,
the legacy logprobs object, and the fields refused with a 400."""

from __future__ import annotations


import httpx
import pytest
from pydantic import ValidationError

from omni_serve.api.completions_protocol import (
    MAX_CHOICES, CompletionChoice, CompletionRequest, CompletionResponse, completion_logprobs,
)
from omni_serve.api.protocol import ChatCompletionTokenLogprob, TopLogprob, UsageInfo
from tests.openai_mock import Recorder, make_client


def entry(token: str, logprob: float, *top: tuple[str, float]) -> ChatCompletionTokenLogprob:
    return ChatCompletionTokenLogprob(token=token, logprob=logprob, bytes=list(token.encode()),
                                      top_logprobs=[TopLogprob(token=t, logprob=v) for t, v in top])


def test_legacy_logprobs_from_entries_count_text_offsets_from_the_start():
    lp = completion_logprobs([entry("Hel", -0.5, ("Hel", -0.5), ("He", -1.0)), entry("lo", -0.25)], offset=5)
    assert lp.tokens == ["Hel", "lo"] and lp.token_logprobs == [-0.5, -0.25]
    # the sampled token is always among the alternatives, as OpenAI's (up to logprobs + 1 of them)
    assert lp.top_logprobs == [{"Hel": -0.5, "He": -1.0}, {"lo": -0.25}] and lp.text_offset == [5, 8]


def test_the_official_client_request_parses_and_its_reply_reads():
    body = CompletionResponse(id="cmpl-1", created=1, model="m", choices=[
        CompletionChoice(index=0, text=" there", finish_reason="length",
                         logprobs=completion_logprobs([entry(" the", -0.1, (" the", -0.1)), entry("re", -2.0)], 0))],
        usage=UsageInfo(prompt_tokens=2, completion_tokens=2, total_tokens=4)).model_dump(exclude_none=True)
    recorder = Recorder(httpx.Response(200, json=body))
    got = make_client(recorder).completions.create(model="m", prompt=["hi", "yo"], max_tokens=3, n=2, logprobs=1,
                                              seed=4, stop=["\n"], echo=False, best_of=2, suffix=None)
    req = CompletionRequest.model_validate(recorder.bodies[0])
    assert req.prompts() == ["hi", "yo"] and req.n == 2 and req.logprobs == 1 and req.stop == ["\n"]
    assert got.choices[0].text == " there" and got.choices[0].logprobs.tokens == [" the", "re"]
    assert got.choices[0].logprobs.top_logprobs == [{" the": -0.1}, {"re": -2.0}] and got.usage.total_tokens == 4


@pytest.mark.parametrize(("prompt", "prompts"), [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, prompts):
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert req.prompts() == prompts and req.max_tokens == 16


@pytest.mark.parametrize(("extra", "words"), [
    ({"prompt": ""}, "must not be empty"),
    ({"prompt": []}, "must not be an empty list"),
    ({"prompt": ["a", [1]]}, "a list of token-id lists"),
    ({"prompt": [True]}, "a list of token-id lists"),
    ({"prompt": ["a"] * 17}, "at most 16 prompts"),
    ({"prompt": "a", "n": MAX_CHOICES + 1}, "prompts x n must be at most 16"),
    ({"prompt": ["a", "b"], "n": 9}, "prompts x n must be at most 16"),
    ({"prompt": "a", "suffix": "z"}, "no insertion mode"),
    ({"prompt": "a", "best_of": 2}, "best_of equal to n"),
    ({"prompt": "a", "logit_bias": {"1": 200}}, "from -100 to 100"),
    ({"prompt": "a", "echo": True, "logprobs": 0}, "echo with logprobs"),
    ({"prompt": "a", "logprobs": 6}, "less than or equal to 5"),
    ({"prompt": "a", "min_tokens": 20}, "min_tokens must not exceed max_tokens"),
])
def test_refused_requests(extra, words):
    with pytest.raises(ValidationError, match=words):
        CompletionRequest.model_validate({"model": "m", **extra})
