"""One ingress over several graphs (``omni_serve.deployments.frontends``), on stand-in frontends: routes merged by
path, a shared path dispatched by the request's model (another model is a 400 naming the served ones), WebSocket
paths by model then intent, health keyed per graph, and the combined app's spec checks
(``omni_serve.deployments.combined.validate``)."""

from __future__ import annotations

import asyncio
import os

import pytest
from pydantic import BaseModel

from omni_serve.api.errors import OpenAIError
from omni_serve.deployments.frontends import ServedFrontends, ServedGraph
from omni_serve.graph.frontend import Route, WebSocketRoute


class Body(BaseModel):
    model: str


class Other(BaseModel):
    prompt: str


class Availability:
    def __init__(self, missing=()):
        self._missing = list(missing)

    def missing(self, grace=True):
        return self._missing


def frontend(model: str, routes, sockets=(), stages=("a",)):
    class F:
        model_name = model
        websocket_routes = tuple(sockets)

        async def health(self):
            return {s: {"model": model} for s in stages}

        async def transcribe(self, body, ctx):
            return model

        async def session(self, ws, ctx):
            return model

    F.routes = tuple(routes)
    return F()


def graphs():
    asr = frontend("asr", [Route("/v1/audio/transcriptions", "t", "transcribe", Body, form=True)],
                   [WebSocketRoute("/v1/realtime", "realtime", "session", intent="transcription")], ("encoder", "llm"))
    omni = frontend("omni", [Route("/v1/audio/transcriptions", "t", "transcribe", Body, form=True),
                             Route("/v1/chat/completions", "chat", "transcribe", Body)],
                    [WebSocketRoute("/v1/realtime", "realtime", "session")], ("thinker",))
    return [ServedGraph("qwen3_asr", None, asr, Availability()), ServedGraph("omni", None, omni,
                                                                             Availability(["thinker"]))]


def test_routes_merge_and_a_shared_path_goes_by_model():
    f = ServedFrontends(graphs())
    assert [r.path for r in f.routes] == ["/v1/audio/transcriptions", "/v1/chat/completions"]
    assert len(f.websocket_routes) == 1 and f.model_names == ["asr", "omni"]
    shared, chat = f.routes
    for model in ("asr", "omni"):
        g = f.graph_for(shared, Body(model=model))
        assert asyncio.run(f.handler(g, shared)(None, None)) == model
    assert f.graph_for(chat, Body(model="anything")).name == "omni"  # one graph serves it: no choice to make
    with pytest.raises(OpenAIError) as err:
        f.graph_for(shared, Body(model="whisper-1"))
    assert err.value.status_code == 400 and err.value.param == "model" and "'asr', 'omni'" in str(err.value)


def test_websockets_go_by_model_then_intent_then_to_conversations():
    f = ServedFrontends(graphs())
    route = f.websocket_routes[0]

    def served(query):
        return asyncio.run(f.websocket_handler(route, query)(None, None))
    assert served({"model": "asr"}) == "asr" and served({"model": "omni"}) == "omni"
    assert served({"intent": "transcription"}) == "asr"
    assert served({}) == "omni"


def test_health_and_missing_stages_are_keyed_per_graph():
    f = ServedFrontends(graphs())
    health = asyncio.run(f.health())
    assert set(health) == {"qwen3_asr/encoder", "qwen3_asr/llm", "omni/thinker"}
    assert f.missing() == ["omni/thinker"]
    one = ServedFrontends(graphs()[:1])
    assert set(asyncio.run(one.health())) == {"encoder", "llm"}  # one graph: its stages' own names


def test_graphs_that_cannot_share_an_ingress_are_refused():
    a = frontend("a", [Route("/v1/x", "x", "transcribe", Body)])
    b = frontend("b", [Route("/v1/x", "x", "transcribe", Other)])
    with pytest.raises(ValueError, match="different request models"):
        ServedFrontends([ServedGraph("a", None, a, Availability()), ServedGraph("b", None, b, Availability())])
    c = frontend("c", [Route("/v1/y", "y", "transcribe", Other)])
    d = frontend("d", [Route("/v1/y", "y", "transcribe", Other)])
    with pytest.raises(ValueError, match="name no model"):
        ServedFrontends([ServedGraph("c", None, c, Availability()), ServedGraph("d", None, d, Availability())])
    with pytest.raises(ValueError, match="distinct model names"):
        ServedFrontends([ServedGraph("a", None, a, Availability()), ServedGraph("a2", None, a, Availability())])


def test_the_combined_spec(omni_tiny_dir, qwen3_asr_tiny_dir, vibevoice_tiny_dir):
    import yaml

    from omni_serve.deployments.combined import validate

    graphs_ = {"qwen3_asr": {"checkpoint": qwen3_asr_tiny_dir}, "qwen2_5_omni": {"checkpoint": omni_tiny_dir}}
    spec, built = validate({"graphs": graphs_, "ingress.request_timeout_s": 60})
    assert [(f.name, s.ingress.request_timeout_s) for f, s in built] == [("qwen3_asr", 60), ("qwen2_5_omni", 60)]
    with pytest.raises(ValueError, match="unknown graph"):
        validate({"graphs": {"nope": {}}})
    with pytest.raises(ValueError, match="share the top-level"):
        validate({"graphs": {"qwen3_asr": {"checkpoint": qwen3_asr_tiny_dir, "ingress.num_cpus": 0}}})
    with pytest.raises(ValueError, match="model names must differ"):
        validate({"graphs": {"qwen3_asr": {"checkpoint": qwen3_asr_tiny_dir},
                             "qwen2_5_omni": {"checkpoint": omni_tiny_dir, "model_name": "qwen3-asr"}}})
    # the shipped config validates (its checkpoints pointed at the tests')
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "omni_serve", "configs", "voice.yaml")) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    args["graphs"]["qwen3_asr"]["checkpoint"] = qwen3_asr_tiny_dir
    args["graphs"]["vibevoice"]["checkpoint"] = vibevoice_tiny_dir
    assert [s.model_name for _, s in validate(args)[1]] == ["vibevoice", "qwen3-asr"]
