"""The HTTP ingress deployment: OpenAI-compatible routes over a graph's frontend.

Routes: ``POST /v1/chat/completions`` (graphs whose frontend has ``prepare``/``complete``/``stream``),
``POST /v1/images/generations`` (frontends with ``generate_images``), ``GET /v1/models``, ``GET /health``
(200 only when every stage answers), ``GET /metrics`` (Prometheus text). A route the served graph does not
offer answers 404 with an OpenAI-style body. Errors are OpenAI-style bodies (see ``omni_serve.api.errors``).
The frontend (``module:Class``) is built with ``(spec, handles)`` and owns graph-specific logic.
"""


import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from ray import serve

from omni_serve.api.errors import OpenAIError, install_error_handlers, not_found
from omni_serve.api.images import ImageGenerationRequest
from omni_serve.api.protocol import ChatCompletionRequest, ModelCard, ModelList
from omni_serve.deployments.stage import import_path

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

    def _require(self, method: str, route: str) -> None:
        if not hasattr(self.frontend, method):
            raise not_found(f"{route} is not served by the {self.model_name!r} graph.")

    async def _counted(self, route: str, call):
        """Await ``call`` (a coroutine), counting its outcome and latency under ``route``."""
        start = time.perf_counter()
        try:
            result = await call
        except OpenAIError as err:
            self.requests.labels(route=route, outcome=f"http_{err.status_code}").inc()
            raise
        self.requests.labels(route=route, outcome="ok").inc()
        self.latency.labels(route=route).observe(time.perf_counter() - start)
        return result

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest):
        self._require("prepare", "/v1/chat/completions")
        try:
            prepared = await self.frontend.prepare(body)
        except OpenAIError as err:
            self.requests.labels(route="chat", outcome=f"http_{err.status_code}").inc()
            raise
        if body.stream:
            self.requests.labels(route="chat", outcome="stream").inc()
            return StreamingResponse(self.frontend.stream(prepared), media_type="text/event-stream")
        response = await self._counted("chat", self.frontend.complete(prepared))
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.post("/v1/images/generations")
    async def images_generations(self, body: ImageGenerationRequest):
        self._require("generate_images", "/v1/images/generations")
        response = await self._counted("images", self.frontend.generate_images(body))
        return JSONResponse(response.model_dump(exclude_none=True))

    @app.get("/v1/models")
    async def models(self):
        return ModelList(data=[ModelCard(id=self.model_name)]).model_dump()

    @app.get("/health")
    async def health(self):
        stages = await self.frontend.health()
        ok = all("error" not in v for v in stages.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "stages": stages},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(self):
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)
