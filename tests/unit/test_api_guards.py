"""The ingress' HTTP guards (``omni_serve.api.guards``): API keys and body limits, on a small app (no Ray)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request, WebSocket
from fastapi.testclient import TestClient

from omni_serve.api.error_handlers import install_error_handlers
from omni_serve.api.guards import ApiKeyAuth, BodyLimit, api_keys

KEY = "sk-test-123"


def make_app(keys=(KEY,), max_bytes=1024, timeout_s=0.5, rejected=None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_bytes, timeout_s=timeout_s, on_reject=rejected)
    app.add_middleware(ApiKeyAuth, keys=keys, protected=("/v1/", "/metrics"), on_reject=rejected)

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.websocket("/v1/realtime")
    async def realtime(websocket: WebSocket):
        await websocket.accept()
        await websocket.send_json({"type": "session.created"})
        await websocket.close()

    @app.get("/health")
    async def health(request: Request):
        return {"authenticated": request.scope["state"]["authenticated"]}

    return app


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_protected_routes_need_the_key_in_openais_401_shape():
    seen = []
    client = TestClient(make_app(keys=(KEY, "sk-other"), rejected=lambda status, err: seen.append(status)))
    err = error_of(client.post("/v1/echo", content=b"x"), 401)
    assert err["code"] == "invalid_api_key" and "didn't provide an API key" in err["message"]
    r = client.post("/v1/echo", content=b"x", headers={"Authorization": "Bearer sk-wrong"})
    err = error_of(r, 401)
    assert r.headers["www-authenticate"] == "Bearer" and "Incorrect API key" in err["message"]
    assert "sk-wrong" not in r.text  # a key is never echoed
    error_of(client.post("/v1/echo", content=b"x", headers={"Authorization": f"Basic {KEY}"}), 401)
    error_of(client.get("/metrics"), 401)
    for key in (KEY, "sk-other"):
        r = client.post("/v1/echo", content=b"abc", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json() == {"bytes": 3}
    assert seen == [401, 401, 401, 401]


def test_open_routes_answer_and_know_who_is_authenticated():
    client = TestClient(make_app())
    assert client.get("/health").json() == {"authenticated": False}
    assert client.get("/health", headers={"Authorization": f"Bearer {KEY}"}).json() == {"authenticated": True}
    open_client = TestClient(make_app(keys=()))
    assert open_client.post("/v1/echo", content=b"x").status_code == 200  # no keys: no authentication
    assert open_client.get("/health").json() == {"authenticated": True}


def test_an_unauthenticated_body_is_never_read():
    """The key is checked before the body: a stranger's huge upload is refused without reading it."""
    reads = []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"x" * 10, "more_body": True}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/echo", "root_path": "", "headers": [],
             "query_string": b"", "server": ("t", 80), "scheme": "http", "client": ("c", 1)}
    asyncio.run(make_app()(scope, receive, send))
    assert sent[0]["status"] == 401 and not reads


def test_bodies_over_the_limit_are_413_from_the_header_or_while_reading():
    seen = []
    client = TestClient(make_app(max_bytes=1024, rejected=lambda status, err: seen.append(status)))
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/v1/echo", content=b"x" * 1024, headers=auth).json() == {"bytes": 1024}
    err = error_of(client.post("/v1/echo", content=b"x" * 1025, headers=auth), 413)
    assert err["code"] == "request_too_large" and "1024" in err["message"]

    def chunks():  # no Content-Length: counted while reading
        for _ in range(10):
            yield b"y" * 200

    error_of(client.post("/v1/echo", content=chunks(), headers=auth), 413)
    error_of(client.post("/v1/echo", content=b"x", headers={**auth, "Content-Length": "abc"}), 400)
    assert seen == [413, 413, 400]


def _slow_request(app, delays: list[float]) -> list[dict]:
    """Drive ``app`` with a body sent in len(delays) chunks, each after its delay; the messages it sent back."""
    parts = iter(delays)

    async def receive():
        try:
            delay = next(parts)
        except StopIteration:
            await asyncio.sleep(3600)  # the client says nothing more
        await asyncio.sleep(delay)
        return {"type": "http.request", "body": b"z", "more_body": True}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/echo", "root_path": "",
             "headers": [(b"authorization", f"Bearer {KEY}".encode())], "query_string": b"", "server": ("t", 80),
             "scheme": "http", "client": ("c", 1)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent


def test_a_body_trickling_in_past_the_timeout_is_408():
    sent = _slow_request(make_app(timeout_s=0.5), [0.1] * 50)  # 5 s of trickle
    assert sent[0]["status"] == 408
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == "body_timeout" and "0.5 s" in err["message"]


def test_api_keys_come_from_the_spec_the_environment_and_a_file(tmp_path, monkeypatch):
    path = tmp_path / "keys"
    path.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    spec = SimpleNamespace(api_keys=["sk-spec", " "], api_key_file=str(path))
    monkeypatch.setenv("OMNI_SERVE_API_KEY", "sk-env-1, sk-env-2,")
    assert api_keys(spec) == {"sk-spec", "sk-env-1", "sk-env-2", "sk-file-1", "sk-file-2"}
    monkeypatch.delenv("OMNI_SERVE_API_KEY")
    assert api_keys(SimpleNamespace(api_keys=[], api_key_file=None)) == frozenset()
    with pytest.raises(OSError):  # a configured key file that cannot be read never means an open API
        api_keys(SimpleNamespace(api_keys=[], api_key_file=str(tmp_path / "missing")))


def test_a_path_that_takes_no_body_never_reads_one():
    """/health, a wrong method and an unknown path are answered at once, whatever body is on its way."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=1024, timeout_s=30, takes_body=lambda path: path == "/v1/echo")

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    for method, path, status in (("GET", "/health", 200), ("POST", "/health", 405), ("POST", "/nothing", 404)):
        reads, sent = [], []

        async def receive():
            reads.append(1)
            await asyncio.sleep(60)  # a client trickling its body
            return {"type": "http.request", "body": b"x", "more_body": True}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"",
                 "headers": [(b"content-length", b"1000000")], "server": ("t", 80), "scheme": "http",
                 "client": ("c", 1)}
        asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
        assert sent[0]["status"] == status and not reads, (method, path)
    r = TestClient(app).post("/v1/echo", content=b"abc")  # a route that takes one still reads it
    assert r.json() == {"bytes": 3}


def test_a_websocket_to_a_protected_path_needs_the_key_before_its_handshake():
    from starlette.websockets import WebSocketDisconnect

    seen = []
    client = TestClient(make_app(rejected=lambda status, err: seen.append(status)))
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
        with pytest.raises(WebSocketDisconnect) as closed:
            with client.websocket_connect("/v1/realtime", headers=headers):
                pass
        assert closed.value.code == 1008
    with client.websocket_connect("/v1/realtime", headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.receive_json() == {"type": "session.created"}
    assert seen == [401, 401]
