"""What a family's ingress-side code looks like: the routes it serves, and how it answers them.

Contract: a family's frontend subclasses ``Frontend`` and lists its HTTP endpoints in ``routes``; the ingress
(``omni_serve.deployments.ingress``) mounts exactly those, with one admission (in-flight limit, deadline),
metrics and error path for all of them, and answers 404 for anything else. A route names the frontend method
that answers it: ``async def handler(self, body, ctx: RequestContext) -> BaseModel | EventStream``, where
``body`` is the route's request model, already validated (JSON body; when ``form``, a multipart form or JSON,
by the request's ``Content-Type``: a JSON body carries no files, so a file field is then left unset).
- Return a pydantic model: the ingress sends it as JSON (``exclude_none``).
- Return an ``EventStream``: the ingress streams its lines (server-sent events) and records the request when the
  stream ends; a failure after the first line must be written into the stream as an error event by the
  frontend, which also sets ``ctx.clock.error`` to the error's type.
- Return a ``ByteStream`` (a file streamed as it is made, e.g. speech audio) or a ``RawReply`` (a body that is not
  JSON, e.g. ``text/plain``): sent with their ``media_type``. A byte stream has no way to carry an error once
  it started: the frontend should hold it back until its first bytes exist (errors before are plain 4xx/5xx),
  and on a later failure set ``ctx.clock.error`` and end it (the client sees a truncated file).
- Raise ``OpenAIError`` for a clear 4xx/5xx before anything is sent.
``websocket_routes`` (``WebSocketRoute``) are sessions rather than requests: the handler gets the accepted
connection and answers bad client messages on it; the ingress caps the sessions per replica
(``ingress.max_realtime_sessions``: beyond, the connection is closed with code 1013, try again later).
``ctx.timeout_s`` is the request's deadline (the graph's ``ingress.request_timeout_s``, lowered by an
``X-Request-Timeout`` header): pass it to ``StageCalls.stream``. ``ctx.clock`` marks first text / audio.

Frontends are built once per ingress replica with ``(spec, stages)``: the validated graph spec and the
``StageCalls`` of the deployed graph. They run in the ingress process, which never loads model code: import only
``api``, ``graphs`` (not a family's ``replica`` package), ``transport`` and preprocessing libraries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, ClassVar, Mapping

from pydantic import BaseModel

from omni_serve.graph.calls import StageCalls
from omni_serve.metrics import RequestClock


@dataclass(frozen=True)
class Route:
    path: str  # e.g. "/v1/images/edits"
    name: str  # the route's label in metrics ("chat", "images", "images_edits")
    handler: str  # the frontend method answering it
    body: type[BaseModel]  # the request model; of a GET or DELETE route, its path and query parameters
    method: str = "POST"
    form: bool = False  # the body is multipart/form-data (files), or JSON (application/json: no files)
    summary: str = ""  # one line for the OpenAPI docs


@dataclass(frozen=True)
class WebSocketRoute:
    """A WebSocket endpoint: the ingress accepts the handshake (its API key checked first) and hands the connection
    to ``async def handler(self, websocket, ctx: RequestContext)``, which owns it until it returns. ``websocket``
    has Starlette's ``receive()``, ``send_text(str)``, ``close(code, reason)`` and ``query_params``."""

    path: str  # e.g. "/v1/realtime"
    name: str  # the route's label in metrics
    handler: str  # the frontend method answering it
    # the ``intent`` query parameter it serves (OpenAI's ``transcription`` sessions); None: conversations. Where one
    # ingress serves several graphs' sessions on a path, a handshake without ``model`` goes by it
    intent: str | None = None


@dataclass
class RequestContext:
    timeout_s: float  # the request's deadline in seconds
    clock: RequestClock = field(default_factory=RequestClock)
    headers: Mapping[str, str] = field(default_factory=dict)  # the HTTP request's headers (case-insensitive)
    # called once when the request ends, however it ends (the reply sent, the stream over, the client gone)
    on_end: list[Callable[[], None]] = field(default_factory=list)
    # a WebSocket session's responses: record(clock, error type or None) counts each one in the route's metrics (the
    # clock is None for one that ended before it was prepared)
    record: Callable[[RequestClock | None, str | None], None] | None = None

    def end(self) -> None:
        """Run (once) what the request asked to be told of its end."""
        hooks, self.on_end[:] = list(self.on_end), []
        for hook in hooks:
            hook()


@dataclass
class EventStream:
    """A streamed reply: server-sent event lines (``omni_serve.api.sse``)."""

    lines: AsyncIterator[str]


@dataclass
class ByteStream:
    """A streamed reply that is one file: its bytes, in order."""

    chunks: AsyncIterator[bytes]
    media_type: str


@dataclass
class RawReply:
    """A whole reply that is not JSON."""

    body: bytes | str
    media_type: str


class Frontend:
    routes: ClassVar[tuple[Route, ...]] = ()
    websocket_routes: ClassVar[tuple[WebSocketRoute, ...]] = ()

    def __init__(self, spec: Any, stages: StageCalls):
        self.spec = spec
        self.stages = stages

    async def start(self) -> None:
        """Called once as the ingress replica starts serving (its ASGI lifespan), before any request: a frontend
        with work of its own (a job queue's workers) starts it here. Nothing by default."""

    async def close(self) -> None:
        """Called once as the ingress replica stops (its ASGI lifespan); idempotent. Nothing by default."""

    @property
    def model_name(self) -> str:
        return self.spec.model_name

    async def health(self) -> dict[str, Any]:
        """Each stage's answer to a probe (``{"error": ...}`` for one that does not answer)."""
        return await self.stages.health()
