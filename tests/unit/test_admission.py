"""Ingress admission without Ray: the in-flight limit (429 + Retry-After, idempotent release) and the
X-Request-Timeout deadline; the OpenAI error handler sends an error's headers."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omni_serve.api.error_handlers import install_error_handlers
from omni_serve.api.errors import OpenAIError
from omni_serve.deployments.admission import InflightLimit, request_deadline


def test_inflight_limit_rejects_beyond_the_limit_with_retry_after():
    limit = InflightLimit(2, retry_after_s=1.5)
    a, b = limit.enter(), limit.enter()
    with pytest.raises(OpenAIError) as exc:
        limit.enter()
    err = exc.value
    assert err.status_code == 429 and err.type == "rate_limit_error" and err.code == "rate_limit_exceeded"
    assert err.headers == {"Retry-After": "2"} and limit.rejected == 1
    a.release()
    a.release()  # idempotent: a stream releases from its generator and from the response's background task
    assert limit.inflight == 1
    c = limit.enter()
    b.release(), c.release()
    assert limit.inflight == 0


@pytest.mark.parametrize("header, expected", [(None, 300.0), ("", 300.0), ("2.5", 2.5), ("900", 300.0)])
def test_request_deadline_may_only_lower_the_default(header, expected):
    assert request_deadline(header, 300.0) == expected


@pytest.mark.parametrize("header", ["soon", "0", "-3", "nan", "inf"])
def test_a_malformed_deadline_is_a_400(header):
    with pytest.raises(OpenAIError) as exc:
        request_deadline(header, 300.0)
    assert exc.value.status_code == 400 and exc.value.param == "X-Request-Timeout"


def test_error_headers_reach_the_response():
    app = FastAPI()
    install_error_handlers(app)
    limit = InflightLimit(0, retry_after_s=3)

    @app.get("/x")
    def x():
        limit.enter()

    r = TestClient(app).get("/x")
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "rate_limit_error"
