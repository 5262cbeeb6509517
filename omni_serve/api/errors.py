"""OpenAI-style errors: the error types every layer raises, and the 400 built from validation errors.

Contract:

* Every error that leaves the HTTP layer has the OpenAI shape
  ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
* ``OpenAIError`` carries the HTTP status next to that body; raise it anywhere
  below a route and ``omni_serve.api.error_handlers.install_error_handlers`` turns it into a response.
* This module imports no web framework (the engines raise ``Draining`` from it, and the GPU check runs them where
  FastAPI is not installed); the handlers that render these errors live in ``omni_serve.api.error_handlers``.
* Request validation failures (including malformed JSON) become 400
  ``invalid_request_error`` with ``code="invalid_request"`` and ``param`` set to
  the path of the first offending field (``messages[0].content[1].input_audio.data``).
* Starlette ``HTTPException`` keeps its status (and headers, e.g. ``Allow`` on 405).
* Anything else becomes a 500 ``internal_error`` with a fixed message naming the
  request id; it is logged with ``logging.exception`` under that id, and the
  exception text is never sent to the client. Code raising a 5xx ``OpenAIError``
  itself must follow the same rule (a fixed message, the detail in the log).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = [
    "OpenAIError",
    "Draining",
    "bad_request",
    "not_found",
    "service_unavailable",
    "too_many_requests",
    "internal_error",
    "from_validation_errors",
]


class OpenAIError(Exception):
    """An error with an HTTP status and an OpenAI-compatible JSON body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - mirrors the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # extra response headers (e.g. Retry-After)

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: ``{"error": {message, type, param, code}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return (
            f"OpenAIError(status_code={self.status_code}, type={self.type!r}, "
            f"param={self.param!r}, message={self.message!r})"
        )


class Draining(RuntimeError):
    """Raised below the HTTP layer by a replica that refuses or gives up a request because it is shutting down (an
    engine after ``drain()``, ``omni_serve.engines.base.Engine``). Nothing is wrong with the request: the ingress
    answers 503 with Retry-After, and a retry reaches another replica. Plain (no HTTP fields), so it crosses a
    process boundary as is."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400 ``invalid_request_error``."""
    return OpenAIError(message, status_code=400, type="invalid_request_error", param=param, code=code)


def not_found(message: str) -> OpenAIError:
    """404 ``not_found_error``."""
    return OpenAIError(message, status_code=404, type="not_found_error")


def service_unavailable(message: str) -> OpenAIError:
    """503 ``service_unavailable``."""
    return OpenAIError(message, status_code=503, type="service_unavailable")


def too_many_requests(message: str, retry_after_s: float) -> OpenAIError:
    """429 ``rate_limit_error`` with a ``Retry-After`` header (whole seconds, at least 1)."""
    return OpenAIError(message, status_code=429, type="rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def internal_error(message: str) -> OpenAIError:
    """500 ``internal_error``."""
    return OpenAIError(message, status_code=500, type="internal_error")


# --------------------------------------------------------------------------- validation

_LOC_ROOTS = {"body", "query", "path", "header", "cookie"}
# Labels pydantic inserts into ``loc`` for union members; they are not field names.
_TYPE_LABELS = {"str", "int", "float", "bool", "bytes", "dict", "list", "none"}
_MAX_LISTED_ERRORS = 3


def _field_path(loc: Sequence[Any]) -> str | None:
    """``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    parts = list(loc)
    if parts and parts[0] in _LOC_ROOTS:
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        if "[" in text or text in _TYPE_LABELS:
            continue
        out = f"{out}.{text}" if out else text
    return out or None


# pydantic's error types for a body that is not a JSON object at all
_NOT_AN_OBJECT = ("model_type", "model_attributes_type", "dict_type")


def from_validation_errors(errors: Sequence[dict[str, Any]]) -> OpenAIError:
    """Turn pydantic/FastAPI validation error dicts into one 400 ``OpenAIError``.

    ``param`` is the path of the first error; the message lists up to three errors.
    A JSON decode error yields ``"Invalid JSON body: <reason> (at position N)"``.
    """
    errors = list(errors)
    if not errors:
        return bad_request("Invalid request", code="invalid_request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error") or first.get("msg") or "could not parse"
        loc = first.get("loc") or ()
        where = f" (at position {loc[-1]})" if loc and isinstance(loc[-1], int) else ""
        return bad_request(f"Invalid JSON body: {reason}{where}", code="invalid_request")
    if tuple(first.get("loc") or ()) == ("body",):
        if first.get("type") == "missing":
            return bad_request("Request body is required (a JSON object)", code="invalid_request")
        if isinstance(first.get("input"), (bytes, bytearray)):
            # FastAPI hands over raw bytes when the Content-Type is not JSON.
            return bad_request(
                "Invalid JSON body: send a JSON object with Content-Type: application/json",
                code="invalid_request",
            )
        if first.get("type") in _NOT_AN_OBJECT:
            return bad_request("Request body must be a JSON object", code="invalid_request")
        # otherwise a check of the whole request (a model validator): listed below, with no param

    lines = []
    for err in errors[:_MAX_LISTED_ERRORS]:
        where = _field_path(err.get("loc") or ()) or "body"
        lines.append(f"{where}: {err.get('msg', 'invalid value')}")
    message = "Invalid request: " + "; ".join(lines)
    if len(errors) > _MAX_LISTED_ERRORS:
        message += f" (and {len(errors) - _MAX_LISTED_ERRORS} more errors)"
    return bad_request(message, param=_field_path(first.get("loc") or ()), code="invalid_request")
