"""JSON request bodies (``omni_serve.api.json_body``): bounded before they are parsed and validated, and the
same 400s FastAPI's own validation gives."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from omni_serve.api import json_body
from omni_serve.api.errors import OpenAIError
from omni_serve.api.protocol import ChatCompletionRequest
from omni_serve.graph.spec import RequestLimits

LIMITS = RequestLimits(max_messages=8, max_content_parts=16, max_prompt_chars=1000)


def parse(raw: bytes, content_type: str | None = "application/json"):
    return asyncio.run(json_body.parse_json_body(raw, content_type, ChatCompletionRequest, LIMITS))


def chat(parts=None, messages=1) -> bytes:
    content = parts if parts is not None else "hi"
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}] * messages}).encode()


def error(raw: bytes, content_type: str | None = "application/json") -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(raw, content_type)
    assert info.value.status_code == 400
    return info.value


def test_a_valid_body_is_its_model():
    req = parse(chat())
    assert isinstance(req, ChatCompletionRequest) and req.messages[0].content == "hi"
    assert parse(chat(), None).model == "m"  # no Content-Type: taken as JSON


def test_too_many_objects_are_refused_from_a_byte_count_without_parsing(monkeypatch):
    monkeypatch.setattr(json, "loads", lambda *a, **kw: pytest.fail("parsed"))
    bound = json_body.json_object_bound(LIMITS)
    err = error(chat([{"type": "text", "text": ""}] * (bound + 1)))
    assert err.code == "request_too_large" and f"holds at most {bound}" in err.message


def test_messages_and_parts_are_counted_before_validation(monkeypatch):
    monkeypatch.setattr(ChatCompletionRequest, "model_validate", classmethod(lambda *a: pytest.fail("validated")))
    err = error(chat(messages=9))
    assert err.param == "messages" and "limits.max_messages" in err.message
    err = error(chat([{"type": "text", "text": "a"}] * 9, messages=2))  # 18 parts in all
    assert "18 content parts" in err.message and "limits.max_content_parts" in err.message


def test_braces_inside_text_never_refuse_a_request_within_the_limits():
    text = "{" * LIMITS.max_prompt_chars  # every character of text a brace
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": "data:,"}}] * 15
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts}] * 1}).encode()
    assert raw.count(b"{") <= json_body.json_object_bound(LIMITS)
    parse(raw)


@pytest.mark.parametrize("raw, content_type, words", [
    (b'{"model": "m",', "application/json", "Invalid JSON body"),
    (b"", "application/json", "Request body is required"),
    (b"[1, 2]", "application/json", "must be a JSON object"),
    (b'{"model": "m"}', "text/plain", "Content-Type: application/json"),
    (b'{"model": "m"}', "application/json", "messages"),
])
def test_bad_bodies_are_fastapi_shaped_400s(raw, content_type, words):
    assert words in error(raw, content_type).message


def test_large_bodies_are_parsed_in_a_worker_thread(monkeypatch):
    threads = []
    real = json_body._parse
    monkeypatch.setattr(json_body, "_parse", lambda *a: threads.append(threading.get_ident()) or real(*a))
    parse(chat())
    parse(chat() + b" " * (json_body.INLINE_BYTES + 1))  # trailing whitespace: still a valid body
    assert threads[0] == threading.get_ident() and threads[1] != threading.get_ident()
