"""Request-size checks that run before any decoding or tokenizing (the graph spec's ``limits`` section).

Contract: each check raises a 400 ``OpenAIError`` naming the limit and the offending field, and costs time in
the number of message parts, never in their size (it runs on the event loop):
- ``check_request_size(messages, limits)``: a chat request's text characters (every text part and string
  content, all messages together) against ``limits.max_prompt_chars``, and its media parts against
  ``limits.max_media_parts``.
- ``check_prompt_chars(texts, limits)``: prompts of an image request (``{param: text}``), together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_serve.api.errors import bad_request

MEDIA_PARTS = ("input_audio", "image_url", "video_url")


def check_request_size(messages: list[Any], limits: Any) -> None:
    chars = media = 0
    for msg in messages:
        content = msg.content
        if isinstance(content, str):
            chars += len(content)
            continue
        for part in content or ():
            if part.type == "text":
                chars += len(part.text)
            elif part.type in MEDIA_PARTS:
                media += 1
    if chars > limits.max_prompt_chars:
        raise bad_request(f"The messages have {chars} characters of text; at most {limits.max_prompt_chars} are "
                          "accepted.", param="messages", code="context_length_exceeded")
    if media > limits.max_media_parts:
        raise bad_request(f"The messages have {media} media parts; at most {limits.max_media_parts} are accepted.",
                          param="messages")


def check_prompt_chars(texts: Mapping[str, str | None], limits: Any) -> None:
    chars = sum(len(t) for t in texts.values() if t)
    if chars > limits.max_prompt_chars:
        param = next(iter(texts))
        raise bad_request(f"{param} has {chars} characters; at most {limits.max_prompt_chars} are accepted.",
                          param=param, code="context_length_exceeded")
