"""The FastAPI handlers that render every error leaving the HTTP layer in OpenAI's shape (``omni_serve.api.errors``).

Contract: :func:`install_error_handlers` registers, on an app before it starts,
* ``OpenAIError`` -> its own status, body and headers (5xx logged);
* request validation failures -> the 400 of ``from_validation_errors``;
* Starlette ``HTTPException`` -> its status and headers (``Allow`` on 405), with an OpenAI body that names the
  route for 404 and 405;
* anything else -> a 500 ``internal_error`` naming the request id, logged with the traceback under that id; the
  exception text is never sent. A middleware returns that 500 itself instead of re-raising (so servers do not log
  twice), unless the response had already started.
"""

from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_serve.api.errors import OpenAIError, from_validation_errors, internal_error

logger = logging.getLogger(__name__)

__all__ = ["install_error_handlers"]

_HTTP_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def _http_error_type(status: int) -> str:
    if status in _HTTP_TYPES:
        return _HTTP_TYPES[status]
    return "internal_error" if status >= 500 else "invalid_request_error"


def _http_error_message(request: Request, exc: StarletteHTTPException) -> str:
    detail = exc.detail
    if exc.status_code == 404 and detail == "Not Found":
        return f"Unknown route: {request.method} {request.url.path}"
    if exc.status_code == 405 and detail == "Method Not Allowed":
        return f"Method {request.method} is not allowed for {request.url.path}"
    if isinstance(detail, str):
        return detail
    return json.dumps(detail, default=str)


def _request_id() -> str:
    from omni_serve.request_ids import serve_request_id

    return serve_request_id() or uuid.uuid4().hex


def _unexpected_error_response(exc: BaseException, rid: str) -> JSONResponse:
    err = internal_error(f"Internal server error (request {rid}); the details are in the server log.")
    return JSONResponse(err.body(), status_code=err.status_code)


async def _openai_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    if exc.status_code >= 500:
        logger.error("%s %s -> %s", request.method, request.url.path, exc)
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


async def _validation_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    err = from_validation_errors(exc.errors())
    return JSONResponse(err.body(), status_code=err.status_code)


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    err = OpenAIError(
        _http_error_message(request, exc),
        status_code=exc.status_code,
        type=_http_error_type(exc.status_code),
    )
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _unhandled_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    rid = _request_id()
    logger.exception("Unhandled error on %s %s (request %s)", request.method, request.url.path, rid, exc_info=exc)
    return _unexpected_error_response(exc, rid)


class _CatchAllMiddleware:
    """Return the 500 body for unexpected errors instead of re-raising them.

    Starlette's own ``Exception`` handler runs in ``ServerErrorMiddleware``, which
    re-raises after responding (so servers log twice and ``TestClient`` raises).
    This middleware sits inside it and swallows the error once the 500 is sent.
    If the response had already started (e.g. mid-stream) it re-raises.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            if started:
                raise
            rid = _request_id()
            logger.exception(
                "Unhandled error on %s %s (request %s)", scope.get("method"), scope.get("path"), rid, exc_info=exc
            )
            await _unexpected_error_response(exc, rid)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Register the OpenAI-shaped error handlers on ``app`` (call before it starts)."""
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unhandled_exception_handler)
    app.add_middleware(_CatchAllMiddleware)
