"""Request ids that tie an HTTP request to every stage's logs and data-plane keys.

Ray Serve gives each HTTP request an id: the client's ``X-Request-ID`` header, or one it generates. It
returns the id in the response's ``X-Request-ID`` header, propagates it through every deployment handle
call, and prints it in each replica's log lines (its ``request_id`` field in JSON logs). ``new_request_id``
builds omni_serve's request id (the response ``id``, the data-plane keys) from it:
``<prefix>-<serve id>-<8 random hex>``. The random suffix keeps two requests that reuse a client id apart.
An id with characters that are unsafe in keys and file names is reduced to the safe ones and cut to 64.
"""

from __future__ import annotations

import re
import uuid

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def serve_request_id() -> str:
    """The id Ray Serve gave the current request ('' outside a Serve request)."""
    try:
        from ray.serve import context

        return context._get_serve_request_context().request_id or ""
    except Exception:  # noqa: BLE001 - not in a Serve replica (unit tests, tools)
        return ""


def new_request_id(prefix: str, serve_id: str | None = None) -> str:
    base = _UNSAFE.sub("", serve_id if serve_id is not None else serve_request_id())[:64]
    suffix = uuid.uuid4().hex[:8] if base else uuid.uuid4().hex
    return f"{prefix}-{base}-{suffix}" if base else f"{prefix}-{suffix}"
