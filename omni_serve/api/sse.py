"""Server-sent-event framing for streamed chat completions.

Contract: each event is one ``data: <compact JSON>\\n\\n`` frame (JSON never
contains a raw newline); pydantic payloads are dumped with ``exclude_none=True``;
the stream ends with :data:`SSE_DONE`. An error after the stream has started is
sent as one :func:`sse_error` event (OpenAI error body), usually followed by
``SSE_DONE``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from omni_serve.api.errors import OpenAIError

__all__ = ["SSE_DONE", "sse_event", "sse_error"]

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
