"""Form routes (``Route.form``) take a multipart or urlencoded form, as FastAPI parses it, or the same fields as a JSON
body, parsed as a JSON route's is (``omni_serve.api.json_body``): the handler gets one validated model either way, a
JSON body leaves the file fields unset, and a bad body is a 400 in OpenAI's shape. No Ray: the ingress' app is built
by ``build_asgi_app`` over a stand-in ingress and frontend."""

from __future__ import annotations

import pytest
from fastapi import UploadFile
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field
from starlette.datastructures import UploadFile as StarletteUpload

from omni_serve.api.videos import VideoCreateRequest
from omni_serve.deployments.ingress import build_asgi_app
from omni_serve.graph.frontend import Route
from omni_serve.graph.spec import IngressSpec, RequestLimits

MAX_BODY_BYTES = 4096


class Upload(BaseModel):
    """A form with files as the image edit route's: a list field under the official client's ``image[]`` name."""

    prompt: str = Field(min_length=1, description="Text.")
    seed: int | None = Field(default=None, ge=0, description="A number.")
    image_list: list[UploadFile] = Field(default_factory=list, alias="image[]", description="Files.")
    mask: UploadFile | None = Field(default=None, description="One file.")


class _Frontend:
    routes = (Route("/v1/videos", "videos", "videos_create", VideoCreateRequest, form=True),
              Route("/v1/uploads", "uploads", "uploads", Upload, form=True))
    websocket_routes = ()

    async def start(self):
        pass

    async def close(self):
        pass


async def _content(value):
    """A body field as the handler sees it, files read (a form's files are Starlette's ``UploadFile``)."""
    if isinstance(value, StarletteUpload):
        return {"filename": value.filename, "data": (await value.read()).decode()}
    if isinstance(value, list):
        return [await _content(v) for v in value]
    return value


class _Ingress:
    """Stands in for ``OpenAIIngress``: what ``build_asgi_app`` reads of it; its routes answer what they were given."""

    family = "test"

    def __init__(self):
        self.frontends = _Frontend()  # one graph: its frontend has what build_asgi_app reads of ServedFrontends
        self.ingress_spec = IngressSpec(enable_docs=True, max_body_bytes=MAX_BODY_BYTES)
        self.limits = RequestLimits(max_prompt_chars=100, max_messages=4, max_content_parts=4)
        self.api_keys = frozenset()
        self.seen = []
        self.rejected_statuses = []

    async def serve_route(self, route, body, request):
        self.seen.append(body)
        return JSONResponse({name: await _content(getattr(body, name)) for name in type(body).model_fields})

    def rejected(self, status, err):
        self.rejected_statuses.append(status)

    async def models(self):
        return {}

    async def health(self):
        return {}

    async def metrics_text(self):
        return {}


@pytest.fixture
def ingress_and_client():
    ingress = _Ingress()
    with TestClient(build_asgi_app(ingress)) as client:
        yield ingress, client


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


def test_a_form_route_takes_a_multipart_form_a_urlencoded_one_and_json_alike(ingress_and_client):
    ingress, client = ingress_and_client
    fields = {"prompt": "a cat on a boat", "seconds": "4", "size": "832x480", "seed": "7"}
    multipart = client.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})
    urlencoded = client.post("/v1/videos", data=fields)
    as_json = client.post("/v1/videos", json={**fields, "seconds": 4, "seed": 7})
    charset = client.post("/v1/videos", content=b'{"prompt": "a cat on a boat", "seconds": 4, "size": "832x480", '
                          b'"seed": 7}', headers={"Content-Type": "application/json; charset=utf-8"})
    for r in (multipart, urlencoded, as_json, charset):
        assert r.status_code == 200, r.text
        assert r.json() == multipart.json()
    assert multipart.json()["seed"] == 7 and multipart.json()["seconds"] == "4"
    assert len(ingress.seen) == 4 and all(isinstance(body, VideoCreateRequest) for body in ingress.seen)


def test_files_come_in_a_form_and_a_json_body_leaves_them_unset(ingress_and_client):
    ingress, client = ingress_and_client
    r = client.post("/v1/uploads", data={"prompt": "edit"},
                    files=[("image[]", ("a.png", b"first", "image/png")), ("image[]", ("b.png", b"second", "image/png")),
                           ("mask", ("m.png", b"holes", "image/png"))])
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "edit", "seed": None, "mask": {"filename": "m.png", "data": "holes"},
                        "image_list": [{"filename": "a.png", "data": "first"}, {"filename": "b.png", "data": "second"}]}
    r = client.post("/v1/uploads", json={"prompt": "edit", "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": "edit", "seed": 3, "image_list": [], "mask": None}
    err = error_of(client.post("/v1/uploads", json={"prompt": "edit", "mask": "bWFzaw=="}))
    assert err["param"] == "mask"  # a file cannot come as JSON
    assert len(ingress.seen) == 2


@pytest.mark.parametrize("send", [
    lambda c: c.post("/v1/videos", json={"prompt": "x", "seed": "many"}),
    lambda c: c.post("/v1/videos", files={"prompt": (None, "x"), "seed": (None, "many")}),
    lambda c: c.post("/v1/videos", data={"prompt": "x", "seed": "many"})], ids=["json", "multipart", "urlencoded"])
def test_a_wrong_typed_field_is_a_400_that_names_it_in_json_and_in_a_form(ingress_and_client, send):
    ingress, client = ingress_and_client
    err = error_of(send(client))
    assert err["param"] == "seed" and err["code"] == "invalid_request" and "seed" in err["message"], err
    assert ingress.seen == []


def test_a_bad_json_body_is_refused_as_on_a_json_route(ingress_and_client):
    ingress, client = ingress_and_client
    headers = {"Content-Type": "application/json"}
    err = error_of(client.post("/v1/videos", content=b'{"prompt": "x",', headers=headers))
    assert err["message"].startswith("Invalid JSON body") and err["code"] == "invalid_request", err
    assert "must be a JSON object" in error_of(client.post("/v1/videos", json=["x"]))["message"]
    assert "required" in error_of(client.post("/v1/videos", content=b"", headers=headers))["message"]
    err = error_of(client.post("/v1/videos", json={"prompt": "{" * 2000}))  # past json_object_bound(limits)
    assert err["code"] == "request_too_large", err
    assert error_of(client.post("/v1/videos", json={}))["param"] == "prompt"
    assert ingress.seen == []


@pytest.mark.parametrize("send", [
    lambda c: c.post("/v1/videos", json={"prompt": "x" * MAX_BODY_BYTES}),
    lambda c: c.post("/v1/uploads", data={"prompt": "x"}, files={"mask": ("m.png", b"\0" * MAX_BODY_BYTES)})],
    ids=["json", "multipart"])
def test_a_body_over_the_ingress_limit_is_refused_before_it_is_parsed(ingress_and_client, send):
    ingress, client = ingress_and_client
    assert error_of(send(client), 413)["code"] == "request_too_large"
    assert ingress.seen == [] and ingress.rejected_statuses == [413]


def test_the_openapi_document_shows_the_form_and_the_json_body(ingress_and_client):
    _, client = ingress_and_client
    document = client.get("/openapi.json").json()
    # a form with files is multipart; FastAPI alone names every Form() model's body urlencoded
    for path, model, form in (("/v1/videos", "VideoCreateRequest", "application/x-www-form-urlencoded"),
                              ("/v1/uploads", "Upload", "multipart/form-data")):
        content = document["paths"][path]["post"]["requestBody"]["content"]
        assert list(content) == [form, "application/json"]
        assert {c["schema"]["$ref"] for c in content.values()} == {f"#/components/schemas/{model}"}
    image_list = document["components"]["schemas"]["Upload"]["properties"]["image[]"]
    assert image_list["items"]["contentMediaType"] == "application/octet-stream"

