"""The ingress' HTTP guards: API-key authentication and request-body limits, as ASGI middleware.

Contract:

* ``api_keys(ingress)`` gathers the accepted keys: ``ingress.api_keys``, the ``OMNI_SERVE_API_KEY`` environment
  variable (comma-separated) and ``ingress.api_key_file`` (one per line; blank lines and ``#`` comments
  skipped). No key anywhere: no authentication. An unreadable key file fails the ingress' start (never an
  open API by accident).
* ``ApiKeyAuth(app, keys, protected)``: a request to a path under one of ``protected`` without
  ``Authorization: Bearer <key>`` for one of ``keys`` is answered 401 in OpenAI's shape (``invalid_api_key``,
  with ``WWW-Authenticate: Bearer``) before its body is read; keys are compared in constant time. Every request
  gets ``scope["state"]["authenticated"]`` (True for a valid key, and for every request when there are no keys)
  so open routes (``/health``) can say less to strangers. A WebSocket handshake to a protected path without a valid
  key is closed before it is accepted (code 1008: the client sees an HTTP 403).
* ``BodyLimit(app, max_bytes, timeout_s, takes_body=None)``: the whole body is read here, before anything parses
  it: 413 when ``Content-Length`` exceeds ``max_bytes`` (nothing read) or when the bytes received do (chunked
  bodies), 408 when the body has not arrived within ``timeout_s`` (a client trickling bytes holds nothing for
  long). The app then receives the body in one message; later ``receive`` calls (disconnect) go to the server.
  A path for which ``takes_body(path)`` is false (no route there reads a body: ``/health``, an unknown path) has
  nothing read at all: the app sees an empty body and answers at once (200, 405 or 404), whatever the client
  is still sending.
* ``on_reject(status, err)`` (optional, both guards) is told of every answer a guard gave itself.

Why our own body limit rather than FastAPI's ``max_body_size``: that exists only in FastAPI >= 0.137 (vLLM pins
below it), and neither it nor Starlette bounds how long a body may take to arrive.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_serve import settings
from omni_serve.api.errors import OpenAIError

log = logging.getLogger(__name__)

Reject = Callable[[int, OpenAIError], None]


def api_keys(ingress: Any) -> frozenset[str]:
    """Every key the ingress accepts (spec, environment, key file); empty: the API is open."""
    keys = [k.strip() for k in ingress.api_keys]
    keys += [k.strip() for k in os.environ.get(settings.API_KEY_ENV, "").split(",")]
    if ingress.api_key_file:  # unreadable: the start fails, loudly
        keys += read_key_file(ingress.api_key_file)
    return frozenset(k for k in keys if k)


def read_key_file(path: str) -> list[str]:
    """The keys of a key file: one per line, blank lines and ``#`` comments skipped (``OSError`` if unreadable)."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]


async def _answer(scope: Scope, receive: Receive, send: Send, err: OpenAIError, on_reject: Reject | None) -> None:
    if on_reject is not None:
        on_reject(err.status_code, err)
    await JSONResponse(err.body(), status_code=err.status_code, headers=err.headers)(scope, receive, send)


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, keys: Iterable[str], protected: tuple[str, ...],
                 on_reject: Reject | None = None):
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.protected = protected
        self.on_reject = on_reject

    def _valid(self, header: str | None) -> bool:
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        given = token.strip().encode()
        # Every key is compared (constant time each), so timing tells nothing about which one nearly matched.
        return any([hmac.compare_digest(given, key) for key in self.keys])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        authenticated = not self.keys or self._valid(header)
        scope.setdefault("state", {})["authenticated"] = authenticated
        if not authenticated and scope["type"] == "websocket" and _path_below_root(scope).startswith(self.protected):
            # closed before the handshake is accepted: the client gets an HTTP 403
            if self.on_reject is not None:
                self.on_reject(401, OpenAIError("invalid API key (WebSocket)", status_code=401))
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid or missing API key"})
            return
        if not authenticated and _path_below_root(scope).startswith(self.protected):
            if header is None:
                message = ("You didn't provide an API key. Send it in an Authorization header using Bearer auth "
                           "(Authorization: Bearer YOUR_KEY).")
            else:
                message = "Incorrect API key provided."
            err = OpenAIError(message, status_code=401, type="invalid_request_error", code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
            await _answer(scope, receive, send, err, self.on_reject)
            return
        await self.app(scope, receive, send)


def _path_below_root(scope: Scope) -> str:
    """The request's path below the app's route prefix (``root_path``) when it is served under one."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _no_body(receive: Receive) -> Receive:
    """A ``receive`` whose first message is an empty body; later calls (disconnect) go to the server."""
    delivered = False

    async def empty() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await receive()

    return empty


class _TooLarge(Exception):
    pass


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(f"Request body is too large (limit {max_bytes} bytes).", status_code=413,
                       type="invalid_request_error", code="request_too_large")


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float, on_reject: Reject | None = None,
                 takes_body: Callable[[str], bool] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.on_reject = on_reject
        self.takes_body = takes_body

    async def _read(self, receive: Receive) -> tuple[bytes, Message | None]:
        """(the body, a disconnect that ended it early or None); raises ``_TooLarge`` / ``TimeoutError``."""
        parts, size = [], 0
        async with asyncio.timeout(self.timeout_s):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return b"".join(parts), message
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    raise _TooLarge
                parts.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(parts), None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.takes_body is not None and not self.takes_body(_path_below_root(scope)):
            await self.app(scope, _no_body(receive), send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            err = _too_large(self.max_bytes) if declared.isdigit() else \
                OpenAIError("Invalid Content-Length header.", status_code=400, type="invalid_request_error")
            await _answer(scope, receive, send, err, self.on_reject)
            return
        try:
            body, early = await self._read(receive)
        except _TooLarge:
            await _answer(scope, receive, send, _too_large(self.max_bytes), self.on_reject)
            return
        except TimeoutError:
            err = OpenAIError(f"The request body did not arrive within {self.timeout_s:g} s.", status_code=408,
                              type="invalid_request_error", code="body_timeout")
            await _answer(scope, receive, send, err, self.on_reject)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return early if early is not None else await receive()

        await self.app(scope, replay, send)


def owner_of(headers) -> str:
    """Whose a request's stored things are (video jobs, registered voices): a digest of its ``Authorization`` header
    (never the key itself), or 'anonymous' without one (every caller is then one owner)."""
    import hashlib

    auth = headers.get("authorization", "")
    return hashlib.sha256(auth.encode()).hexdigest()[:32] if auth else "anonymous"
