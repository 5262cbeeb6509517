"""GET and DELETE routes of a frontend: their path and query parameters declared to FastAPI from the route's model
(listed in the OpenAPI document, parsed by FastAPI), the handler given one validated model, and a bad parameter a
400 in OpenAI's shape that names it. No Ray: the endpoints are mounted on a bare FastAPI app."""

from __future__ import annotations

from typing import Literal

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from omni_serve.api.error_handlers import install_error_handlers
from omni_serve.deployments.ingress import _endpoint
from omni_serve.graph.frontend import Route


class Content(BaseModel):
    video_id: str = Field(pattern=r"^video_\w+$", description="The job's id.")
    variant: Literal["video", "thumbnail"] = Field("video", description="Which file.")


class Page(BaseModel):
    after: str | None = Field(None, description="The last id of the page before.")
    limit: int = Field(20, ge=1, le=100, description="Jobs per page.")
    order: Literal["asc", "desc"] = Field("desc", description="By creation time.")


class _Ingress:
    """Stands in for ``OpenAIIngress``: records what the route's handler would get."""

    def __init__(self):
        self.seen = []

    async def serve_route(self, route, body, request):
        self.seen.append((route.name, body))
        return {"route": route.name, **body.model_dump()}


ROUTES = (Route("/v1/videos/{video_id}/content", "videos_content", "content", Content, method="GET"),
          Route("/v1/videos/{video_id}", "videos_delete", "delete", Content, method="DELETE"),
          Route("/v1/videos", "videos_list", "list", Page, method="GET"))


@pytest.fixture
def ingress_and_client():
    ingress, app = _Ingress(), FastAPI()
    install_error_handlers(app)
    for route in ROUTES:
        app.add_api_route(route.path, _endpoint(ingress, route), methods=[route.method], name=route.name)
    return ingress, TestClient(app)


def test_path_and_query_parameters_reach_the_handler_as_one_model(ingress_and_client):
    ingress, client = ingress_and_client
    assert client.get("/v1/videos/video_12/content?variant=thumbnail").json() == \
        {"route": "videos_content", "video_id": "video_12", "variant": "thumbnail"}
    assert client.get("/v1/videos/video_12/content").json()["variant"] == "video"
    assert client.delete("/v1/videos/video_34").json()["video_id"] == "video_34"
    assert client.get("/v1/videos?limit=5&order=asc&after=video_1").json() == \
        {"route": "videos_list", "after": "video_1", "limit": 5, "order": "asc"}
    assert client.get("/v1/videos").json() == {"route": "videos_list", "after": None, "limit": 20, "order": "desc"}
    assert all(isinstance(body, (Content, Page)) for _, body in ingress.seen)


@pytest.mark.parametrize("path, param", [
    ("/v1/videos/video_12/content?variant=spritesheet", "variant"), ("/v1/videos?limit=0", "limit"),
    ("/v1/videos?limit=many", "limit"), ("/v1/videos?order=up", "order"), ("/v1/videos/x-1/content", "video_id")])
def test_a_bad_parameter_is_a_400_that_names_it(ingress_and_client, path, param):
    ingress, client = ingress_and_client
    r = client.get(path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or ""), error
    assert ingress.seen == []


def test_the_parameters_are_in_the_openapi_document(ingress_and_client):
    _, client = ingress_and_client
    paths = client.get("/openapi.json").json()["paths"]
    content = {p["name"]: p["in"] for p in paths["/v1/videos/{video_id}/content"]["get"]["parameters"]}
    assert content == {"video_id": "path", "variant": "query"}
    assert {p["name"] for p in paths["/v1/videos"]["get"]["parameters"]} == {"after", "limit", "order"}
    assert "requestBody" not in paths["/v1/videos"]["get"]


def test_a_path_parameter_without_a_field_is_refused_when_mounted():
    with pytest.raises(TypeError, match="no field"):
        _endpoint(_Ingress(), Route("/v1/videos/{job}", "x", "x", Content, method="GET"))
