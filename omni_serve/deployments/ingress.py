"""The HTTP ingress deployment: OpenAI-compatible routes over a graph's frontend.

Routes: ``POST /v1/chat/completions`` (graphs whose frontend has ``prepare``/``complete``/``stream``),
``POST /v1/images/generations`` (frontends with ``generate_images``), ``GET /v1/models``, ``GET /health``
(200 only when every stage answers), ``GET /metrics`` (this replica's request counters, Prometheus text;
the cluster-wide metrics of ``omni_serve.metrics`` go through Ray's metrics endpoint). A route the served
graph does not offer answers 404 with an OpenAI-style body. Errors are OpenAI-style bodies (see ``omni_serve.api.errors``).
The frontend (``module:Class``) is built with ``(spec, handles)`` and owns graph-specific logic.

Overload and deadlines (``omni_serve.deployments.admission``): beyond ``ingress.max_inflight_requests``
per replica a request is answered 429 with ``Retry-After`` at once; Serve itself answers 503 with
``Retry-After`` beyond ``ingress.max_queued_requests`` queued for the replicas; every request runs under
its deadline (``ingress.request_timeout_s``, lowered by an ``X-Request-Timeout`` header) and gets a 504
past it.
"""

import asyncio
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from ray import serve
from starlette.background import BackgroundTask

from omni_serve.api.errors import OpenAIError, install_error_handlers, not_found
from omni_serve.api.images import ImageGenerationRequest
from omni_serve.api.protocol import ChatCompletionRequest, ModelCard, ModelList
from omni_serve.deployments.admission import TIMEOUT_HEADER, InflightLimit, Ticket, request_deadline
from omni_serve.deployments.stage import import_path
from omni_serve.metrics import IngressMetrics, RequestClock, observe_transfers

app = FastAPI(title="omni_serve", description="OpenAI-compatible API over omni_serve stage graphs")
install_error_handlers(app)


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, frontend: str, spec_cls: str, graph_spec: dict[str, Any], **handles):
        spec = import_path(spec_cls).model_validate(graph_spec)
        self.model_name = spec.model_name
        self.frontend = import_path(frontend)(spec, handles)
        self.registry = CollectorRegistry()
        self.requests = Counter("omni_serve_requests", "HTTP requests by route and outcome", ["route", "outcome"],
                                registry=self.registry)
        self.latency = Histogram("omni_serve_request_latency_seconds", "Request latency (non-streaming)",
                                 ["route"], registry=self.registry)
        self.metrics = IngressMetrics()  # cluster-wide, through Ray's metrics endpoint
        observe_transfers()
        self.inflight = InflightLimit(spec.ingress.max_inflight_requests, spec.ingress.retry_after_s)
        self.default_timeout_s = spec.ingress.request_timeout_s

    def _admit(self, route: str, request: Request) -> tuple[Ticket, float]:
        """(the request's in-flight ticket, its deadline in seconds), or a 429/400 raised."""
        try:
            timeout_s = request_deadline(request.headers.get(TIMEOUT_HEADER), self.default_timeout_s)
            return self.inflight.enter(), timeout_s
        except OpenAIError as err:
            self._failed(route, err)
            raise

    def _require(self, method: str, route: str) -> None:
        if not hasattr(self.frontend, method):
            raise not_found(f"{route} is not served by the {self.model_name!r} graph.")

    def _failed(self, route: str, err: BaseException) -> None:
        if isinstance(err, OpenAIError):
            outcome, kind = f"http_{err.status_code}", err.type
        else:
            outcome, kind = "http_500", type(err).__name__
        self.requests.labels(route=route, outcome=outcome).inc()
        self.metrics.failed(route, kind, outcome)

    async def _counted(self, route: str, call, clock: RequestClock):
        """Await ``call`` (a coroutine), counting its outcome and latency under ``route``."""
        try:
            result = await call
        except Exception as err:
            self._failed(route, err)
            raise
        self.requests.labels(route=route, outcome="ok").inc()
        self.latency.labels(route=route).observe(clock.figures()["e2e"])
        self.metrics.finished(route, clock)
        return result

    async def _timed_stream(self, lines: AsyncIterator[str], clock: RequestClock,
                            ticket: Ticket) -> AsyncIterator[str]:
        """The SSE stream, recording its outcome and timings once it ends (or the client leaves)."""
        try:
            async for line in lines:
                yield line
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.failed("chat", "client_disconnected", "cancelled")
            raise
        finally:
            ticket.release()
        if clock.error is None:
            self.metrics.finished("chat", clock)
        else:
            self.metrics.failed("chat", clock.error, "stream_error")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        clock = RequestClock()
        self._require("prepare", "/v1/chat/completions")
        ticket, timeout_s = self._admit("chat", request)
        streaming = False
        try:
            try:
                prepared = await self.frontend.prepare(body)
            except OpenAIError as err:
                self._failed("chat", err)
                raise
            prepared.clock, prepared.timeout_s = clock, timeout_s
            if body.stream:
                self.requests.labels(route="chat", outcome="stream").inc()
                streaming = True
                return StreamingResponse(self._timed_stream(self.frontend.stream(prepared), clock, ticket),
                                         media_type="text/event-stream", background=BackgroundTask(ticket.release))
            response = await self._counted("chat", self.frontend.complete(prepared), clock)
            return JSONResponse(response.model_dump(exclude_none=True))
        finally:
            if not streaming:
                ticket.release()

    @app.post("/v1/images/generations")
    async def images_generations(self, body: ImageGenerationRequest, request: Request):
        clock = RequestClock()
        self._require("generate_images", "/v1/images/generations")
        ticket, timeout_s = self._admit("images", request)
        try:
            response = await self._counted("images", self.frontend.generate_images(body, timeout_s=timeout_s),
                                           clock)
        finally:
            ticket.release()
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.get("/v1/models")
    async def models(self):
        return ModelList(data=[ModelCard(id=self.model_name)]).model_dump()

    @app.get("/health")
    async def health(self):
        stages = await self.frontend.health()
        ok = all("error" not in v for v in stages.values())
        ingress = {"inflight": self.inflight.inflight, "max_inflight": self.inflight.limit,
                   "rejected": self.inflight.rejected}
        return JSONResponse({"status": "ok" if ok else "unavailable", "ingress": ingress, "stages": stages},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(self):
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
