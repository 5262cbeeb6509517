"""The HTTP ingress deployment: the routes a family's frontend declares, mounted generically.

Contract: ``OpenAIIngress(family, graph_spec, **handles)`` loads the family (``module:FAMILY``), validates the spec
and builds the family's frontend with the spec and the ``StageCalls`` over the stage handles (stage name -> handle).
Given lists of families and specs it serves them all (a combined app, ``omni_serve.deployments.combined``): their
routes merged, a path several graphs serve chosen by the request's ``model`` (``omni_serve.deployments.frontends``),
``/v1/models`` listing every graph's model, ``/health`` every graph's stages.
Its FastAPI app is built per replica (Serve's ``__serve_build_asgi_app__``) from the frontend's ``routes``
(``omni_serve.graph.frontend``: a POST route's body is JSON, or for a form route a multipart form or JSON, by its
``Content-Type``; a GET or DELETE route's path and query parameters are its model's fields), plus ``GET /v1/models``,
``GET /health`` (200 only when every stage answers and has a running replica and the data plane's directory answers;
``omni_serve.deployments.health``: answered from a cache refreshed at most every 2 s, never one probe per call;
``?fresh=1`` from an authenticated caller probes now) and ``GET /metrics`` (this replica's request counters,
Prometheus text; the cluster-wide metrics of ``omni_serve.metrics`` go through Ray's metrics endpoint). Any other
route answers 404 with an OpenAI-style body naming only the method and path asked for; all errors are OpenAI-style
bodies (``omni_serve.api.errors``). ``/docs``, ``/redoc`` and ``/openapi.json`` exist only with
``ingress.enable_docs``. ``record_autoscaling_stats()`` reports the speech load of a graph that admits by real-time
capacity to Serve's autoscaler (``omni_serve.autoscaling``).

The frontend's ``websocket_routes`` (``/v1/realtime`` on the Omni graphs) are mounted too: a handshake is refused
beyond ``ingress.max_realtime_sessions`` open sessions per replica (accepted, then closed with code 1013), else
accepted and handed to the frontend's handler for the session's life (the frontend admits its responses by the
graph's real-time capacity; they do not count against ``ingress.max_inflight_requests``).

Guards (``omni_serve.api.guards``), before any body is read or parsed: with API keys configured, ``/v1/*`` and
``/metrics`` need ``Authorization: Bearer <key>`` (401 otherwise) and ``/health`` tells an unauthenticated
caller only its status; only the routes that take a body have one read (a body sent to ``/health`` or an
unknown path is never read, so it holds nothing); every body is bounded (``ingress.max_body_bytes``: 413) and
must arrive within ``ingress.body_timeout_s`` (408). A JSON body is then bounded in objects, messages and content
parts before it is parsed and validated (``omni_serve.api.json_body``), on a form route as on a JSON one (a JSON
body carries no files: a form route's file fields are then left unset).

Every frontend route goes through one path: admission, the handler, metrics and errors. Beyond
``ingress.max_inflight_requests`` per replica a request is answered 429 with ``Retry-After`` at once (Serve
itself answers 503 with ``Retry-After`` beyond ``ingress.max_queued_requests`` queued for the replicas; while a
stage has no running replica, ``omni_serve.deployments.availability``, a request is answered 503 at once); the
request's deadline (``ingress.request_timeout_s``, lowered by an ``X-Request-Timeout`` header) reaches the
handler in its ``RequestContext``; outcomes and latencies are counted under the route's name. A streamed reply
(``EventStream``, ``ByteStream``) holds its in-flight slot until the stream ends, however it ends.
"""

import asyncio
import contextlib
import inspect
import typing
import re
from typing import Annotated, Any, AsyncIterator, Callable

from fastapi import FastAPI, Form, Request, WebSocket, WebSocketDisconnect
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from ray import serve
from starlette.background import BackgroundTask

from omni_serve.api.error_handlers import install_error_handlers
from omni_serve.api.errors import OpenAIError, from_validation_errors
from omni_serve.api.guards import ApiKeyAuth, BodyLimit, api_keys
from omni_serve.api.json_body import is_json, parse_json_body
from omni_serve.api.protocol import ModelCard, ModelList
from omni_serve.deployments.admission import TIMEOUT_HEADER, InflightLimit, Ticket, request_deadline
from omni_serve.deployments.availability import StageAvailability
from omni_serve.deployments.frontends import ServedFrontends, ServedGraph
from omni_serve.deployments.health import GraphHealth, directory_state
from omni_serve.deployments.stage_cpu import StageCpuReader
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.frontend import ByteStream, EventStream, RawReply, RequestContext, Route, WebSocketRoute
from omni_serve.graph.registry import import_path, load_family
from omni_serve.graph.stage_settings import stage_views
from omni_serve.metrics import IngressMetrics, RequestClock, observe_transfers
from omni_serve.transport.connectors import keep_node_tidy


@serve.deployment
@serve.ingress()
class OpenAIIngress:
    def __init__(self, family: str | list[str], graph_spec: dict[str, Any] | list[dict[str, Any]], **handles):
        """One graph (``family``: its ``module:FAMILY`` path, ``graph_spec`` its spec's values, ``handles`` its
        stages' by stage name), or several (lists of both, ``handles`` keyed ``<family>/<stage>``: a combined app,
        ``omni_serve.deployments.combined``). The ingress settings are the first graph's."""
        single = isinstance(family, str)
        paths, specs = ([family], [graph_spec]) if single else (list(family), list(graph_spec))
        graphs = []
        for path, values in zip(paths, specs):
            fam = load_family(path)
            # a Serve config file carries what the ingress reads of each stage in its own deployment entry
            spec = fam.spec.model_validate(stage_views(values))
            own = handles if single else {k.split("/", 1)[1]: h for k, h in handles.items()
                                          if k.split("/", 1)[0] == fam.name}
            frontend = import_path(fam.frontend)(spec, StageCalls.over_serve(fam.graph, spec, own))
            availability = StageAvailability(own, {s for s in own if (spec.stage_spec(s).autoscaling_config or {})
                                                   .get("min_replicas", 1) == 0})
            frontend.stages.missing_stages = availability.missing
            realtime = getattr(frontend, "realtime", None)
            if realtime is not None and realtime.settings.policy != "none" and realtime.settings.one_more == "auto":
                realtime.cpu_source = StageCpuReader(own)  # admission projects the stages' CPU use
            graphs.append(ServedGraph(fam.name, spec, frontend, availability))
        self.frontends = ServedFrontends(graphs)
        self.family = "+".join(g.name for g in graphs)
        spec = graphs[0].spec
        self.registry = CollectorRegistry()
        self.requests = Counter("omni_serve_requests", "HTTP requests by route and outcome", ["route", "outcome"],
                                registry=self.registry)
        self.latency = Histogram("omni_serve_request_latency_seconds", "Request latency (non-streaming)",
                                 ["route"], registry=self.registry)
        self.metrics = IngressMetrics()  # cluster-wide, through Ray's metrics endpoint
        observe_transfers()
        self.inflight = InflightLimit(spec.ingress.max_inflight_requests, spec.ingress.retry_after_s)
        self.default_timeout_s = spec.ingress.request_timeout_s
        # graphs that speak: the client their stall metrics assume
        playback = next((p for g in graphs if (p := getattr(g.spec, "playback", None)) is not None), None)
        self.client_buffer_s = playback.client_buffer_s if playback is not None else 0.5
        self.ingress_spec = spec.ingress
        self.limits = spec.limits
        self.api_keys = api_keys(spec.ingress)
        self.graph_health = GraphHealth(self.frontends.health, directory_state)
        self.sessions = 0  # open WebSocket sessions (ingress.max_realtime_sessions)
        keep_node_tidy(spec.data_plane)  # this node's shm janitor while a replica runs here

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_asgi_app(self)

    # -- one path for every frontend route ----------------------------------------------------------------
    def _admit(self, route: str, request: Request, graph: ServedGraph) -> tuple[Ticket, float]:
        """(the request's in-flight ticket, its deadline in seconds), or a 429/400/503 raised."""
        try:
            timeout_s = request_deadline(request.headers.get(TIMEOUT_HEADER), self.default_timeout_s)
            missing = graph.availability.missing()
            if missing:
                raise OpenAIError(
                    f"Stage {', '.join(missing)} has no running replica (its node was lost or it is being "
                    "replaced); retry the request.", status_code=503, type="service_unavailable",
                    code="stage_unavailable", headers={"Retry-After": str(max(1, round(self.inflight.retry_after_s)))})
            return self.inflight.enter(), timeout_s
        except OpenAIError as err:
            self._failed(route, err)
            raise

    def _failed(self, route: str, err: BaseException) -> None:
        if isinstance(err, OpenAIError):
            outcome, kind = f"http_{err.status_code}", err.type
        else:
            outcome, kind = "http_500", type(err).__name__
        self.requests.labels(route=route, outcome=outcome).inc()
        self.metrics.failed(route, kind, outcome)

    async def serve_route(self, route: Route, body: Any, request: Request) -> Response:
        clock = RequestClock(buffer_s=self.client_buffer_s)
        try:
            graph = self.frontends.graph_for(route, body)
        except OpenAIError as err:
            self._failed(route.name, err)
            raise
        ticket, timeout_s = self._admit(route.name, request, graph)
        ctx = RequestContext(timeout_s, clock, request.headers)
        ctx.on_end.append(ticket.release)
        streaming = False
        try:
            try:
                reply = await self.frontends.handler(graph, route)(body, ctx)
            except Exception as err:
                self._failed(route.name, err)
                raise
            if isinstance(reply, (EventStream, ByteStream)):
                self.requests.labels(route=route.name, outcome="stream").inc()
                streaming = True
                lines, media_type = ((reply.lines, "text/event-stream") if isinstance(reply, EventStream)
                                     else (reply.chunks, reply.media_type))
                return StreamingResponse(self._timed_stream(route.name, lines, clock, ctx.end),
                                         media_type=media_type, background=BackgroundTask(ctx.end))
            self.requests.labels(route=route.name, outcome="ok").inc()
            self.latency.labels(route=route.name).observe(clock.figures()["e2e"])
            self.metrics.finished(route.name, clock)
            if isinstance(reply, RawReply):
                return Response(reply.body, media_type=reply.media_type)
            return JSONResponse(reply.model_dump(exclude_none=True))
        finally:
            if not streaming:
                ctx.end()

    async def serve_websocket(self, route: WebSocketRoute, websocket: WebSocket) -> None:
        """A WebSocket session (its key was checked by ``ApiKeyAuth``): refused beyond the replica's cap, else
        accepted and handed to the frontend until either side ends it."""
        if self.sessions >= self.ingress_spec.max_realtime_sessions:
            self.requests.labels(route=route.name, outcome="refused").inc()
            await websocket.accept()  # accepted, then closed: the client sees 1013 (try again later), not a 403
            await websocket.close(code=1013, reason="too many realtime sessions on this replica; try again later")
            return
        self.sessions += 1
        self.requests.labels(route=route.name, outcome="session").inc()
        def record(clock: RequestClock | None, error: str | None) -> None:  # one response of the session
            if error is None and clock is not None:
                self.metrics.finished(route.name, clock)
            else:  # a barge-in or response.cancel is the client's choice, as a client leaving a stream is
                self.metrics.failed(route.name, error or "unknown", "cancelled" if error == "cancelled"
                                    else "stream_error")

        try:
            await websocket.accept()
            await self.frontends.websocket_handler(route, websocket.query_params)(websocket, RequestContext(
                self.default_timeout_s, headers=websocket.headers, record=record))
        except WebSocketDisconnect:
            pass
        finally:
            self.sessions -= 1

    async def _timed_stream(self, route: str, lines: AsyncIterator[str | bytes], clock: RequestClock,
                            end: Callable[[], None]) -> AsyncIterator[str | bytes]:
        """The streamed reply (SSE lines or a file's bytes), recording its outcome and timings once it ends (or the
        client leaves)."""
        try:
            async for line in lines:
                yield line
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.failed(route, "client_disconnected", "cancelled")
            raise
        finally:
            end()  # the in-flight slot, and what the frontend holds for the request (e.g. its audio stream's place)
        if clock.error is None:
            self.metrics.finished(route, clock)
        else:
            self.metrics.failed(route, clock.error, "stream_error")

    # -- fixed routes -----------------------------------------------------------------------------------------
    async def models(self):
        return ModelList(data=[ModelCard(id=name) for name in self.frontends.model_names]).model_dump()

    async def health(self, request: Request):
        insider = request.scope.get("state", {}).get("authenticated", True)
        fresh = insider and request.query_params.get("fresh", "") not in ("", "0", "false")
        cached, data_plane = await self.graph_health.get(fresh=fresh)
        stages = dict(cached)
        for stage in self.frontends.missing(grace=False):
            stages[stage] = {**stages.get(stage, {}), "error": "no running replica"}
        ok = all("error" not in v for v in stages.values()) and "error" not in data_plane
        status = {"status": "ok" if ok else "unavailable"}
        if insider:  # strangers learn only the status
            status["ingress"] = {"inflight": self.inflight.inflight, "max_inflight": self.inflight.limit,
                                 "rejected": self.inflight.rejected}
            status["stages"] = stages
            status["data_plane"] = data_plane
            realtime = self.frontends.realtime
            if realtime is not None:
                status["ingress"]["realtime"] = realtime.state()
        return JSONResponse(status, status_code=200 if ok else 503)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook: the speech load of a graph that admits by real-time capacity
        (``RealtimeAdmission.autoscaling_stats``), which ``omni_serve.autoscaling.StageRatioPolicy``'s ``speech``
        scales the stages that bound speech on; nothing for a graph that does not. Async: it runs on the replica's
        event loop, where the admission's state changes (a plain method would run in Serve's thread pool)."""
        realtime = self.frontends.realtime
        return {} if realtime is None else realtime.autoscaling_stats()

    def rejected(self, status: int, err: OpenAIError) -> None:
        """A guard answered a request itself (401, 408, 413)."""
        self._failed("auth" if status == 401 else "body", err)

    async def metrics_text(self):
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


_PATH_PARAMETER = re.compile(r"{(\w+)}")


def build_asgi_app(ingress: OpenAIIngress) -> FastAPI:
    """The replica's FastAPI app: the frontend's routes, then the fixed ones, then OpenAI-style errors."""
    docs = ingress.ingress_spec.enable_docs

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):  # Serve runs the replica's ASGI lifespan: the frontend's own work
        await ingress.frontends.start()
        try:
            yield
        finally:
            await ingress.frontends.close()

    app = FastAPI(title="omni_serve", description=f"OpenAI-compatible API over the {ingress.family} stage graph",
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None, lifespan=lifespan)
    install_error_handlers(app)
    # Added last = outermost: the key is checked before the body is read.
    spec = ingress.ingress_spec
    app.add_middleware(BodyLimit, max_bytes=spec.max_body_bytes, timeout_s=spec.body_timeout_s,
                       on_reject=ingress.rejected, takes_body=lambda path: _takes_body(app, path))
    app.add_middleware(ApiKeyAuth, keys=ingress.api_keys, protected=("/v1/", "/metrics"), on_reject=ingress.rejected)
    for route in ingress.frontends.routes:
        app.router.add_api_route(route.path, _endpoint(ingress, route), methods=[route.method], name=route.name,
                                 summary=route.summary or None,
                                 route_class_override=FormOrJsonRoute if route.form else None)
    for ws_route in ingress.frontends.websocket_routes:
        app.add_api_websocket_route(ws_route.path, _websocket_endpoint(ingress, ws_route), name=ws_route.name)
    app.add_api_route("/v1/models", ingress.models, methods=["GET"], name="models")
    app.add_api_route("/health", ingress.health, methods=["GET"], name="health")
    app.add_api_route("/metrics", ingress.metrics_text, methods=["GET"], name="metrics")
    if docs:
        app.openapi = lambda: _openapi_with_json_bodies(app, ingress.frontends.routes)
    return app


def _takes_body(app: FastAPI, path: str) -> bool:
    """Whether a route of ``app`` at ``path`` reads a request body (a POST/PUT/PATCH route matches it)."""
    return any(isinstance(r, APIRoute) and r.methods & {"POST", "PUT", "PATCH"} and r.path_regex.match(path)
               for r in app.routes)


def _openapi_with_json_bodies(app: FastAPI, routes: tuple[Route, ...]) -> dict[str, Any]:
    """FastAPI's OpenAPI document plus the JSON routes' request bodies (their endpoints parse the body
    themselves, so FastAPI does not see the model), and on each form route the JSON body it also takes (the form's
    model)."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    json_routes = [r for r in routes if not r.form and r.method not in ("GET", "DELETE")]
    refs, defs = models_json_schema([(r.body, "validation") for r in json_routes],
                                    ref_template="#/components/schemas/{model}")
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
    for route in json_routes:
        operation = schema["paths"][route.path][route.method.lower()]
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[(route.body, "validation")]}}}
    for route in routes:
        if route.form:
            body = schema["paths"][route.path][route.method.lower()]["requestBody"]
            form = next(iter(body["content"].values()))
            # FastAPI names a Form() model's body urlencoded even when it has files: those need multipart
            body["content"] = {"multipart/form-data" if _has_files(route.body) else
                               "application/x-www-form-urlencoded": form, "application/json": form}
    app.openapi_schema = schema
    return schema


def _has_files(model: type) -> bool:
    """Whether a form's model has a file field (an ``UploadFile``, a list of them, or an optional one)."""
    from fastapi import UploadFile

    def files(annotation) -> bool:
        return annotation is UploadFile or any(files(a) for a in typing.get_args(annotation))
    return any(files(field.annotation) for field in model.model_fields.values())


def _websocket_endpoint(ingress: OpenAIIngress, route: WebSocketRoute):
    async def websocket_endpoint(websocket: WebSocket):
        await ingress.serve_websocket(route, websocket)

    return websocket_endpoint


class FormOrJsonRoute(APIRoute):
    """The route class of a form route (``Route.form``): a form (multipart, or urlencoded) is FastAPI's to parse,
    as for any ``Form()`` endpoint; a JSON body (``is_json``: ``application/json``, ``+json`` or no
    ``Content-Type``) goes to the endpoint's ``json_endpoint``, parsed as a JSON route's body is."""

    def get_route_handler(self) -> Callable[[Request], Any]:
        form_handler = super().get_route_handler()
        json_handler = self.endpoint.json_endpoint

        async def handler(request: Request) -> Response:
            if is_json(request.headers.get("content-type")):
                return await json_handler(request)
            return await form_handler(request)

        return handler


def _endpoint(ingress: OpenAIIngress, route: Route):
    """A FastAPI endpoint for ``route``. A multipart form is FastAPI's to parse (``Form()``); a JSON body is
    parsed here (``omni_serve.api.json_body``: bounded before it is parsed and validated, large ones in a
    thread), so the OpenAPI page shows the model's schema by reference only. A form route's endpoint carries the
    JSON one as ``json_endpoint``, which ``FormOrJsonRoute`` (the route class it is mounted with) calls for a JSON
    body."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    if route.method in ("GET", "DELETE"):
        return _parameters_endpoint(ingress, route)

    async def json_endpoint(request: Request):
        body = await parse_json_body(await request.body(), request.headers.get("content-type"), route.body,
                                     ingress.limits)
        return await ingress.serve_route(route, body, request)

    if route.form:
        async def form_endpoint(body, request: Request):
            return await ingress.serve_route(route, body, request)

        form_endpoint.__signature__ = inspect.Signature([
            inspect.Parameter("body", kind, annotation=Annotated[route.body, Form()]),
            inspect.Parameter("request", kind, annotation=Request)])
        form_endpoint.json_endpoint = json_endpoint
        return form_endpoint
    return json_endpoint


def _parameters_endpoint(ingress: OpenAIIngress, route: Route):
    """A GET or DELETE route's endpoint: ``route.body`` is the model of its parameters, those named in the path
    (``/v1/videos/{video_id}``) and the query's (the rest of its fields). Each is declared to FastAPI (so the OpenAPI
    page lists them and FastAPI parses them, a bad one a 400 in OpenAI's shape), then the model is built from them
    and validated as a body would be."""
    from fastapi import Path, Query

    in_path = set(_PATH_PARAMETER.findall(route.path))
    missing = in_path - set(route.body.model_fields)
    if missing:
        raise TypeError(f"route {route.path}: {route.body.__name__} has no field for {sorted(missing)}")
    kind = inspect.Parameter.KEYWORD_ONLY
    parameters = [inspect.Parameter("request", kind, annotation=Request)]
    for name, field in route.body.model_fields.items():
        where = Path(description=field.description) if name in in_path else Query(description=field.description)
        default = inspect.Parameter.empty if field.is_required() else field.default
        parameters.append(inspect.Parameter(name, kind, annotation=Annotated[field.annotation, where],
                                            default=default))

    async def parameters_endpoint(request: Request, **values):
        try:
            body = route.body.model_validate(values)
        except ValidationError as err:
            raise from_validation_errors(err.errors()) from None
        return await ingress.serve_route(route, body, request)

    parameters_endpoint.__signature__ = inspect.Signature(parameters)
    return parameters_endpoint
