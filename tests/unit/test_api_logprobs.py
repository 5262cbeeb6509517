"""OpenAI's logprobs objects: built from token ids (LogprobWriter) and read back by the official client, non-streamed
and streamed; the request's logprobs fields."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from omni_serve.api.logprobs import LogprobWriter
from omni_serve.api.protocol import (
    ChatCompletionChoice, ChatCompletionChunk, ChatCompletionChunkChoice, ChatCompletionDelta, ChatCompletionMessage,
    ChatCompletionRequest, ChatCompletionResponse, ChoiceLogprobs,
)
from omni_serve.api.sse import SSE_DONE, sse_event
from tests.openai_mock import Recorder, make_client


class Vocab:
    """A tokenizer's ``decode`` over a fixed table (the writer reads nothing else)."""

    table = {1: "Hello", 2: " wor", 3: "ld", 4: "\ufffd", 9: "<|im_end|>"}

    def __init__(self):
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return "".join(self.table[i] for i in ids)


def test_writer_builds_one_entry_per_token_with_its_alternatives_in_order() -> None:
    vocab = Vocab()
    entries = LogprobWriter(vocab).entries([1, 4, 9], [(-0.5, [(1, -0.5), (2, -1.5)]), (-2.0, []), (-0.1, [(9, -0.1)])])
    assert [e.token for e in entries] == ["Hello", "\ufffd", "<|im_end|>"]
    assert [e.logprob for e in entries] == [-0.5, -2.0, -0.1]
    assert entries[0].bytes == list(b"Hello") and entries[1].bytes == list("\ufffd".encode())
    assert [(t.token, t.logprob) for t in entries[0].top_logprobs] == [("Hello", -0.5), (" wor", -1.5)]
    assert entries[1].top_logprobs == []
    assert vocab.calls == 4  # each distinct token decoded once
    ruled_out = LogprobWriter(vocab).entries([1], [(-0.0, [(1, 0.0), (2, -float("inf"))])])[0]
    assert [t.logprob for t in ruled_out.top_logprobs] == [0.0, -9999.0]  # JSON has no -inf: vLLM's floor
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        LogprobWriter(vocab).entries([1], [(-1.0, []), (-1.0, [])])


def test_official_client_reads_logprobs_non_streamed() -> None:
    entries = LogprobWriter(Vocab()).entries([1, 2], [(-0.25, [(1, -0.25), (3, -2.0)]), (-1.0, [(3, -0.5), (2, -1.0)])])
    body = ChatCompletionResponse(id="chatcmpl-1", created=1, model="m", choices=[ChatCompletionChoice(
        message=ChatCompletionMessage(content="Hello wor"), finish_reason="length",
        logprobs=ChoiceLogprobs(content=entries))]).model_dump(exclude_none=True)
    resp = make_client(Recorder(httpx.Response(200, json=body))).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2)
    content = resp.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("Hello", -0.25, list(b"Hello")),
                                                                   (" wor", -1.0, list(b" wor"))]
    assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("ld", -0.5), (" wor", -1.0)]


def test_official_client_reads_logprobs_streamed() -> None:
    writer = LogprobWriter(Vocab())

    def chunk(text: str | None, ids: list[int], finish=None) -> ChatCompletionChunk:
        logprobs = ChoiceLogprobs(content=writer.entries(ids, [(-1.0, [])] * len(ids))) if ids else None
        return ChatCompletionChunk(id="c", created=1, model="m", choices=[ChatCompletionChunkChoice(
            delta=ChatCompletionDelta(content=text), finish_reason=finish, logprobs=logprobs)])

    stream = "".join(sse_event(c) for c in [chunk("", []), chunk("Hello", [1]), chunk(" world", [2, 3]),
                                             chunk(None, [9], finish="stop")]) + SSE_DONE
    reply = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=stream.encode())
    received = list(make_client(Recorder(reply)).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], logprobs=True, stream=True))
    tokens = [c.token for r in received if r.choices[0].logprobs for c in r.choices[0].logprobs.content]
    assert tokens == ["Hello", " wor", "ld", "<|im_end|>"]
    assert json.loads(stream.split("\n")[0][len("data: "):])["choices"][0].get("logprobs") is None


def test_request_logprobs_fields() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(base).logprobs_wanted() is None
    assert ChatCompletionRequest.model_validate({**base, "logprobs": False, "top_logprobs": 0}).logprobs_wanted() is None
    assert ChatCompletionRequest.model_validate({**base, "logprobs": True}).logprobs_wanted() == 0
    assert ChatCompletionRequest.model_validate({**base, "logprobs": True, "top_logprobs": 20}).logprobs_wanted() == 20
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs: true"):
        ChatCompletionRequest.model_validate({**base, "top_logprobs": 2})
