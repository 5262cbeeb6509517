"""Server-sent-event framing for streamed chat completions.

Contract: each event is one ``data: <compact JSON>\\n\\n`` frame (JSON never
contains a raw newline); pydantic payloads are dumped with ``exclude_none=True``;
the stream ends with :data:`SSE_DONE`. An error after the stream has started is
sent as one :func:`sse_error` event (OpenAI error body), usually followed by
``SSE_DONE``; :func:`sse_failure` builds that event for any exception a stream raised.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel

from omni_serve.api.errors import OpenAIError, internal_error

__all__ = ["SSE_DONE", "sse_event", "sse_error", "sse_failure"]

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any]) -> str:
    """Frame a pydantic model or a JSON-able dict as one SSE ``data:`` event."""
    if isinstance(payload, BaseModel):
        text = payload.model_dump_json(exclude_none=True)
    else:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


def sse_error(err: OpenAIError) -> str:
    """An SSE event whose data is ``err.body()``."""
    return sse_event(err.body())


def sse_failure(exc: Exception, request_id: str, clock, log: logging.Logger) -> str:
    """The error event of a stream that failed after its first line (the response has started: an error event,
    never a cut connection). An ``OpenAIError`` is sent as it is; anything else is logged with its traceback and
    sent as an internal error naming the request. ``clock.error`` (the request's metrics) records the type."""
    if not isinstance(exc, OpenAIError):
        log.error("request %s: the stream failed", request_id, exc_info=exc)
        exc = internal_error(f"Internal server error (request {request_id}); the details are in the server log.")
    clock.error = exc.type
    return sse_error(exc)
