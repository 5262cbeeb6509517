"""The JSON routes' request bodies, parsed into their models here rather than by FastAPI, so that what a body may
cost is bounded before the costly steps run.

Contract: ``await parse_json_body(raw, content_type, model, limits)`` returns ``model`` validated from ``raw``,
or raises a 400 ``OpenAIError`` in the shapes FastAPI's own validation gives (``from_validation_errors``):

* Before parsing, the body's ``{`` bytes are counted (``json_object_bound(limits)``): in a request within the
  limits every object is a message, a content part or an object inside one, and every other ``{`` is a character
  of text, which ``limits.max_prompt_chars`` bounds. A body of a million tiny objects is refused after a
  ``bytes.count`` (milliseconds for the largest body), never parsed.
* After parsing, before validation: at most ``limits.max_messages`` messages and at most
  ``limits.max_content_parts`` content parts in all of them (``len`` of each list, nothing walked).
* Bodies above ``INLINE_BYTES`` are parsed and validated in a worker thread. The json module and pydantic hold
  the GIL while they run, so the thread alone would bound nothing: the counts above are what keep each run
  short; the thread lets the event loop's other tasks run between the steps.

A non-JSON ``Content-Type`` (``is_json``: anything but ``application/json`` or ``+json``; none at all is taken as
JSON), an empty body, invalid JSON and a non-object body are 400s naming the problem.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from omni_serve.api.errors import bad_request, from_validation_errors

INLINE_BYTES = 64 << 10  # smaller bodies parse in well under a millisecond: no thread hop
# Objects a message or part may hold besides itself (image_url.url, input_audio, a tool's parameters...).
OBJECTS_PER_ITEM = 4
SLACK_OBJECTS = 1024  # the request's own object and its top-level options (response_format, tools, ...)

M = TypeVar("M", bound=BaseModel)


def json_object_bound(limits: Any) -> int:
    """The most ``{`` bytes a body within ``limits`` can hold (see the module docstring)."""
    items = limits.max_messages + limits.max_content_parts
    return items * OBJECTS_PER_ITEM + limits.max_prompt_chars + SLACK_OBJECTS


def _check_braces(raw: bytes, limits: Any) -> None:
    braces = raw.count(b"{")
    if braces > json_object_bound(limits):
        raise bad_request(f"The request body holds {braces} JSON objects; a request within this server's limits "
                          f"(limits.max_messages {limits.max_messages}, limits.max_content_parts "
                          f"{limits.max_content_parts}, limits.max_prompt_chars {limits.max_prompt_chars}) "
                          f"holds at most {json_object_bound(limits)}.", code="request_too_large")


def check_counts(obj: Any, limits: Any) -> None:
    """At most ``max_messages`` messages and ``max_content_parts`` content parts, by ``len`` alone."""
    messages = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(messages, list):
        return
    if len(messages) > limits.max_messages:
        raise bad_request(f"messages has {len(messages)} items; at most {limits.max_messages} are accepted "
                          "(limits.max_messages).", param="messages", code="request_too_large")
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if parts > limits.max_content_parts:
        raise bad_request(f"The messages have {parts} content parts; at most {limits.max_content_parts} are "
                          "accepted (limits.max_content_parts).", param="messages", code="request_too_large")


def is_json(content_type: str | None) -> bool:
    """Whether a body of ``content_type`` is JSON (``application/json`` or ``+json``; none at all is taken as JSON)."""
    if not content_type:
        return True
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or mime.endswith("+json")


def _parse(raw: bytes, model: type[M], limits: Any) -> M:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        pos = getattr(exc, "pos", None)
        raise from_validation_errors([{"type": "json_invalid", "loc": ("body", pos) if pos is not None else ("body",),
                                       "msg": "JSON decode error", "ctx": {"error": getattr(exc, "msg", str(exc))}}]
                                     ) from None
    if not isinstance(obj, dict):
        raise bad_request("Request body must be a JSON object", code="invalid_request")
    check_counts(obj, limits)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise from_validation_errors([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def parse_json_body(raw: bytes, content_type: str | None, model: type[M], limits: Any) -> M:
    if not is_json(content_type):
        raise bad_request("Invalid JSON body: send a JSON object with Content-Type: application/json",
                          code="invalid_request")
    if not raw.strip():
        raise bad_request("Request body is required (a JSON object)", code="invalid_request")
    _check_braces(raw, limits)
    if len(raw) <= INLINE_BYTES:
        return _parse(raw, model, limits)
    return await asyncio.to_thread(_parse, raw, model, limits)
