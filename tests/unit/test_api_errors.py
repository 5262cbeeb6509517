"""Unit tests for omni_serve.api.errors and omni_serve.api.error_handlers: OpenAI error bodies and FastAPI handlers."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from fastapi import FastAPI, HTTPException
from fastapi.testclient import TestClient

from omni_serve.api.error_handlers import install_error_handlers
from omni_serve.api.errors import (
    OpenAIError,
    bad_request,
    from_validation_errors,
    internal_error,
    not_found,
    service_unavailable,
)
from omni_serve.api.protocol import ChatCompletionRequest

ERROR_KEYS = {"message", "type", "param", "code"}


def make_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/chat/completions")
    def chat(req: ChatCompletionRequest) -> dict[str, Any]:
        return {"model": req.model, "audio": req.wants_audio()}

    @app.get("/raise/openai")
    def raise_openai() -> None:
        raise service_unavailable("engine is warming up")

    @app.get("/raise/bad")
    def raise_bad() -> None:
        raise bad_request("voice 'Nobody' is unknown", param="audio.voice", code="unknown_voice")

    @app.get("/raise/http")
    def raise_http() -> None:
        raise HTTPException(status_code=409, detail="conflict here")

    @app.get("/raise/boom")
    async def raise_boom() -> None:
        raise RuntimeError("secret internal detail")

    return app


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(make_app())


def error_of(resp: Any) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    return body["error"]


# ----------------------------------------------------------------------------- OpenAIError


def test_openai_error_body_and_helpers() -> None:
    err = OpenAIError("nope", status_code=422, type="x_error", param="a.b", code="c")
    assert isinstance(err, Exception) and str(err) == "nope"
    assert (err.message, err.status_code, err.type, err.param, err.code) == ("nope", 422, "x_error", "a.b", "c")
    assert err.body() == {"error": {"message": "nope", "type": "x_error", "param": "a.b", "code": "c"}}

    default = OpenAIError("m")
    assert (default.status_code, default.type, default.param, default.code) == (400, "invalid_request_error", None, None)

    assert (bad_request("b", "p", "c").status_code, bad_request("b").type) == (400, "invalid_request_error")
    assert bad_request("b", param="p").param == "p"
    assert (not_found("n").status_code, not_found("n").type) == (404, "not_found_error")
    assert (service_unavailable("s").status_code, service_unavailable("s").type) == (503, "service_unavailable")
    assert (internal_error("i").status_code, internal_error("i").type) == (500, "internal_error")


def test_from_validation_errors_paths_and_summary() -> None:
    errors = [
        {"loc": ("body", "messages", 0, "content", "content[parts]", 1, "part[input_audio]", "input_audio", "data"), "msg": "Field required", "type": "missing"},
        {"loc": ("body", "stop", "list[str]"), "msg": "too long", "type": "too_long"},
        {"loc": ("body", "temperature"), "msg": "too hot", "type": "x"},
        {"loc": ("body", "top_p"), "msg": "too big", "type": "x"},
    ]
    err = from_validation_errors(errors)
    assert err.status_code == 400 and err.code == "invalid_request"
    assert err.param == "messages[0].content[1].input_audio.data"
    assert "messages[0].content[1].input_audio.data: Field required" in err.message
    assert "stop: too long" in err.message and "temperature: too hot" in err.message
    assert "top_p" not in err.message and "1 more" in err.message


# ----------------------------------------------------------------------------- handlers


def test_valid_request_passes_through(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 200
    assert resp.json() == {"model": "m", "audio": False}


def test_malformed_json_is_400(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", content=b'{"model": "m",', headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_request"
    assert err["message"].startswith("Invalid JSON body: ")
    assert err["param"] is None


def test_non_json_content_type_and_empty_body_are_400(client: TestClient) -> None:
    resp = client.post("/v1/chat/completions", content=b"hello", headers={"content-type": "text/plain"})
    assert resp.status_code == 400
    assert "Content-Type: application/json" in error_of(resp)["message"]
    resp = client.post("/v1/chat/completions", content=b"", headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert "body is required" in error_of(resp)["message"]
    resp = client.post("/v1/chat/completions", json=[1, 2])
    assert resp.status_code == 400
    assert error_of(resp)["message"] == "Request body must be a JSON object"


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "only n=1 is supported"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature", "less than or equal to 2"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "modalities": ["video"]}, "modalities[0]", "modalities[0]: "),
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "model: Field required"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}]},
            "messages[0].content[1].input_audio.data",
            "Field required",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["1", "2", "3", "4", "5"]}, "stop", "at most 4"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}],
          "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name", "should match"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice",
         'tool_choice "required" needs tools'),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs",
         "top_logprobs needs logprobs: true"),
        # a check of the whole request: its message, no param (not "must be a JSON object")
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "min_tokens": 5, "max_tokens": 2}, None,
         "min_tokens must not exceed max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs", "less than or equal to 20"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
         "response_format", "type json_schema needs json_schema"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty",
         "less than or equal to 2"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"x7": 5}}, "logit_bias",
         "keys must be token ids"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"\u00b2": 1}}, "logit_bias",
         "keys must be token ids"),  # a digit to str.isdigit, not to int()
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": -101}}, "logit_bias",
         "from -100 to 100"),
    ],
)
def test_validation_errors_are_400_with_param(client: TestClient, body: dict[str, Any], param: str, fragment: str) -> None:
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    err = error_of(resp)
    assert err["type"] == "invalid_request_error"
    assert err["code"] == "invalid_request"
    assert err["param"] == param
    assert fragment in err["message"]


def test_unknown_route_is_404(client: TestClient) -> None:
    resp = client.get("/v1/nothing-here")
    assert resp.status_code == 404
    err = error_of(resp)
    assert err["type"] == "not_found_error"
    assert "/v1/nothing-here" in err["message"]


def test_wrong_method_is_405_with_allow(client: TestClient) -> None:
    resp = client.get("/v1/chat/completions")
    assert resp.status_code == 405
    assert resp.headers["allow"] == "POST"
    err = error_of(resp)
    assert err["type"] == "invalid_request_error"
    assert "GET" in err["message"]


def test_openai_error_keeps_status_and_fields(client: TestClient) -> None:
    resp = client.get("/raise/openai")
    assert resp.status_code == 503
    assert error_of(resp) == {"message": "engine is warming up", "type": "service_unavailable", "param": None, "code": None}
    resp = client.get("/raise/bad")
    assert resp.status_code == 400
    assert error_of(resp) == {"message": "voice 'Nobody' is unknown", "type": "invalid_request_error", "param": "audio.voice", "code": "unknown_voice"}


def test_http_exception_detail_is_kept(client: TestClient) -> None:
    resp = client.get("/raise/http")
    assert resp.status_code == 409
    assert error_of(resp)["message"] == "conflict here"


def test_unexpected_exception_is_500_and_logged(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="omni_serve.api.error_handlers"):
        resp = client.get("/raise/boom")  # default TestClient re-raises server errors; this must not
    assert resp.status_code == 500
    err = error_of(resp)
    assert err["type"] == "internal_error"
    assert "secret internal detail" not in err["message"] and "RuntimeError" not in err["message"]
    records = [r for r in caplog.records if r.name == "omni_serve.api.error_handlers"]
    assert records and records[0].exc_info is not None
    assert "secret internal detail" in caplog.text
    rid = err["message"].split("(request ")[1].split(")")[0]
    assert rid and rid in records[0].getMessage()  # the id in the answer finds the detail in the log


def test_a_stage_failure_reaches_the_client_as_a_fixed_message_with_the_request_id() -> None:
    from ray.exceptions import RayActorError

    from omni_serve.graph.calls import stage_error

    failed = stage_error("thinker", RuntimeError("CUDA error at /secret/path.cu:12"), "chatcmpl-abc")
    assert failed.status_code == 500 and failed.type == "internal_error"
    assert failed.message == "Stage thinker failed on request chatcmpl-abc; the details are in the server log."
    lost = stage_error("talker", RayActorError(), "chatcmpl-abc")
    assert lost.status_code == 503 and lost.headers == {"Retry-After": "1"}
    assert "chatcmpl-abc" in lost.message and "actor" not in lost.message.lower()


def test_openapi_schema_builds_with_protocol_models() -> None:
    schema = make_app().openapi()
    assert "ChatCompletionRequest" in schema["components"]["schemas"]
