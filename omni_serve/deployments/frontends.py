"""The graphs one ingress serves: one frontend each, their routes merged, each request handed to its graph.

Contract: ``ServedFrontends(graphs)`` over ``ServedGraph``s (a graph's name, spec, frontend and stage availability).
One graph is the usual app; several are a combined app (``omni_serve.deployments.combined``), where one ingress
serves every graph's routes:
- ``routes`` / ``websocket_routes``: one per method and path. A path that several graphs serve is one route whose
  requests go to the graph whose ``model_name`` the body's ``model`` names (the graphs must then take the same body
  model: it is parsed once, before the graph is known); another model is a 400 ``model_not_found`` naming the
  served ones. A WebSocket path several graphs serve goes by the ``model`` query parameter, else by the ``intent``
  one (``WebSocketRoute.intent``: ``transcription`` sessions), else to the graph whose route has no intent.
- ``graph_for(route, body)`` -> the ``ServedGraph`` that answers; ``handler(graph, route)`` its frontend's method.
- ``health()``: every graph's stages (keyed ``<graph>/<stage>`` when there are several); ``missing(grace)``: stages
  with no running replica, keyed the same way; ``model_names``; ``start()`` / ``close()`` run every frontend's.
- ``realtime``: the real-time admission of the first graph that has one (its speech load is what the ingress
  reports to Serve's autoscaler), or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_serve.api.errors import bad_request
from omni_serve.graph.frontend import Frontend, Route, WebSocketRoute


@dataclass
class ServedGraph:
    name: str  # the family's name
    spec: Any  # its validated spec
    frontend: Frontend
    availability: Any  # omni_serve.deployments.availability.StageAvailability over its stages' handles


class ServedFrontends:
    def __init__(self, graphs: list[ServedGraph]):
        if not graphs:
            raise ValueError("an ingress serves at least one graph")
        names = [g.frontend.model_name for g in graphs]
        if len(set(names)) != len(names):
            raise ValueError(f"the graphs of one ingress need distinct model names, got {names}")
        self.graphs = graphs
        self.combined = len(graphs) > 1
        self._by_route: dict[tuple[str, str], list[tuple[ServedGraph, Route]]] = {}
        for g in graphs:
            for r in g.frontend.routes:
                self._by_route.setdefault((r.method, r.path), []).append((g, r))
        for (method, path), served in self._by_route.items():
            bodies = {r.body for _, r in served}
            if len(bodies) > 1 or len({r.form for _, r in served}) > 1:
                raise ValueError(f"{method} {path} is served by {[g.name for g, _ in served]} with different request "
                                 "models: one ingress cannot serve them together")
            if len(served) > 1 and "model" not in served[0][1].body.model_fields:
                raise ValueError(f"{method} {path} is served by {[g.name for g, _ in served]} but its requests name "
                                 "no model to choose the graph by")
        self.routes = tuple(served[0][1] for served in self._by_route.values())
        self._by_socket: dict[str, list[tuple[ServedGraph, WebSocketRoute]]] = {}
        for g in graphs:
            for r in g.frontend.websocket_routes:
                self._by_socket.setdefault(r.path, []).append((g, r))
        self.websocket_routes = tuple(served[0][1] for served in self._by_socket.values())

    @property
    def model_names(self) -> list[str]:
        return [g.frontend.model_name for g in self.graphs]

    @property
    def realtime(self):
        return next((r for g in self.graphs if (r := getattr(g.frontend, "realtime", None)) is not None), None)

    # -- dispatch -----------------------------------------------------------------------------------------------
    def graph_for(self, route: Route, body: Any) -> ServedGraph:
        served = self._by_route[(route.method, route.path)]
        if len(served) == 1:
            return served[0][0]
        model = getattr(body, "model", None)
        for g, _ in served:
            if g.frontend.model_name == model:
                return g
        raise bad_request(f"The model {model!r} does not exist here; {route.path} serves "
                          f"{', '.join(repr(g.frontend.model_name) for g, _ in served)}.", param="model",
                          code="model_not_found")

    def handler(self, graph: ServedGraph, route: Route):
        own = next(r for g, r in self._by_route[(route.method, route.path)] if g is graph)
        return getattr(graph.frontend, own.handler)

    def websocket_handler(self, route: WebSocketRoute, query: Any):
        """The frontend method that serves a WebSocket on ``route`` with the handshake's ``query`` parameters."""
        served = self._by_socket[route.path]
        chosen = served[0]
        if len(served) > 1:
            model, intent = query.get("model"), query.get("intent")
            chosen = (next((s for s in served if model and s[0].frontend.model_name == model), None)
                      or next((s for s in served if intent and s[1].intent == intent), None)
                      or next((s for s in served if s[1].intent is None), None) or chosen)
        return getattr(chosen[0].frontend, chosen[1].handler)

    # -- the graphs together ------------------------------------------------------------------------------------
    def _key(self, graph: ServedGraph, stage: str) -> str:
        return f"{graph.name}/{stage}" if self.combined else stage

    async def health(self) -> dict[str, Any]:
        out = {}
        for g in self.graphs:
            for stage, info in (await g.frontend.health()).items():
                out[self._key(g, stage)] = info
        return out

    def missing(self, grace: bool = True) -> list[str]:
        return [self._key(g, s) for g in self.graphs for s in g.availability.missing(grace=grace)]

    async def start(self) -> None:
        for g in self.graphs:
            await g.frontend.start()

    async def close(self) -> None:
        for g in self.graphs:
            await g.frontend.close()
