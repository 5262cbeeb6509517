"""Graphs are data: every family's declaration is consistent, the registry finds families (built-in and plug-in),
and what crosses a stage boundary is always a declared, typed message, never a string-keyed dict.

The proof that no dict crosses a boundary has three parts: (1) a declaration whose messages are not typed all
the way down is refused at import (``GraphDef``); (2) every crossing checks types at run time (stage calls and
outputs in ``StageRunner.handle`` and ``StageCalls``, edge payloads in ``StageIO``/``StageCalls.put``), and a dict
is refused at each; (3) real requests through each family's in-process graph, recorded at every crossing, carry
only messages with no dict inside.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata

import pytest
import torch
from pydantic import BaseModel, ValidationError

from omni_serve.graph.calls import StageCalls
from omni_serve.graph.graph import EdgeDef, EngineKind, GraphDef, StageDef, untyped_fields
from omni_serve.graph.local import LocalGraph
from omni_serve.graph.messages import Message, StreamChunk, Tensor
from omni_serve.graph.registry import families, import_path
from omni_serve.graph.runner import build_runner
from omni_serve.graph.spec import EdgeSpec
from omni_serve.transport import registry
from omni_serve.transport.memory import MemoryConnector


@pytest.mark.parametrize("name", sorted(families()))
def test_each_family_declares_its_graph_once(name):
    family = families()[name]
    graph = family.graph
    # the spec's sections are the declaration's, in order
    spec_fields = family.spec.model_fields
    assert list(spec_fields["stages"].annotation.model_fields) == [s.name for s in graph.stages]
    assert list(spec_fields["edges"].annotation.model_fields) == [e.name for e in graph.edges]
    for stage in graph.stages:
        assert import_path(stage.runner) and import_path(stage.adapter)
        assert spec_fields["stages"].annotation.model_fields[stage.name].description == stage.description
    for message in graph.message_types():
        assert issubclass(message, Message) and untyped_fields(message) == []
    for layout in graph.layouts:
        links = graph.links(layout)
        assert len({link.edge for link in links}) == len(links)
        deployed = {s.name for s in graph.deployed(layout)}
        assert all(link.reader in deployed for link in links)
    assert import_path(family.frontend).routes, "a frontend serves at least one route"


def _stage(name, call, **kw):
    return StageDef(name, "x", "m:R", EngineKind.STEP, "m:A", call=call, **kw)


class Call(Message):
    request_id: str


class Payload(Message):
    x: Tensor


class Chunk(StreamChunk):
    x: Tensor


class Loose(Message):
    settings: dict[str, float]


class Hidden(Message):
    inner: Loose


class AnyField(Message):
    value: object


@pytest.mark.parametrize("stages, edges, error", [
    ((_stage("a", Call, writes=("a_b",)), _stage("b", Call, reads=("a_b",))), (EdgeDef("a_b", Payload, "x"),), None),
    ((_stage("a", Loose),), (), "typed all the way down"),
    ((_stage("a", Call, writes=("a_b",)), _stage("b", Hidden, reads=("a_b",))), (EdgeDef("a_b", Payload, "x"),),
     "typed all the way down"),
    ((_stage("a", AnyField),), (), "typed all the way down"),
    ((_stage("a", Call, writes=("a_b",)), _stage("b", Call, reads=("a_b",)), _stage("c", Call, reads=("a_b",))),
     (EdgeDef("a_b", Payload, "x"),), "one writer and one reader"),
    ((_stage("a", Call, writes=("nowhere",)),), (), "undeclared edges"),
    ((_stage("a", Call, writes=("a_b",)), _stage("b", Call, reads=("a_b",))),
     (EdgeDef("a_b", Payload, "x", stream=True),), "StreamChunk"),
    ((_stage("a", Call, writes=("a_b",)), _stage("b", Call, reads=("a_b",))),
     (EdgeDef("a_b", Chunk, "x", stream=True), EdgeDef("unused", Payload, "x")), "used in no layout"),
    ((_stage("a", Call), _stage("a", Call)), (), "duplicate stage"),
    ((_stage("ingress", Call),), (), "identifiers"),
])
def test_bad_declarations_are_refused(stages, edges, error):
    if error is None:
        GraphDef("ok", stages=stages, edges=edges)
        return
    with pytest.raises((TypeError, ValueError), match=error):
        GraphDef("bad", stages=stages, edges=edges)


def test_edge_connectors_are_names_in_the_connector_registry():
    with pytest.raises(ValidationError, match="unknown connector 'nvlink'.*registered connectors: auto, memory"):
        EdgeSpec(connector="nvlink")
    registry.register_connector("custom_test", "omni_serve.transport.memory:MemoryConnector")
    try:
        assert EdgeSpec(connector="custom_test").connector == "custom_test"
    finally:
        registry._REGISTRY.pop("custom_test")


def test_a_served_graph_refuses_an_in_process_connector(qwen_image_tiny_dir):
    from omni_serve.deployments.builder import build_app
    from omni_serve.graph.serve_config import build_serve_config

    args = {"checkpoint": qwen_image_tiny_dir, "edges.dit_vae.connector": "memory"}
    for build in (lambda: build_app(families()["qwen_image"], args), lambda: build_serve_config("qwen_image", args)):
        with pytest.raises(ValueError, match="edges.dit_vae.connector='memory' works inside one process only"):
            build()


def test_connectors_of_the_entry_point_group_are_known_everywhere(monkeypatch):
    toy = importlib.metadata.EntryPoint(name="toy_memory", value="omni_serve.transport.memory:MemoryConnector",
                                        group=registry.ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [toy] if group == registry.ENTRY_POINT_GROUP else real(group=group, **kw))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    try:
        assert EdgeSpec(connector="toy_memory").connector == "toy_memory"
        assert registry.connector_class("toy_memory") is MemoryConnector
    finally:
        registry._REGISTRY.pop("toy_memory", None)


def test_a_family_names_its_graph_and_a_graph_without_edges_describes_itself():
    from omni_serve.graph.family import Family
    from tests.toy_family.graph import GRAPH
    from tests.toy_family.spec import ToySpec

    with pytest.raises(ValueError, match="give both one name"):
        Family(name="other", module=__name__, description="x", graph=GRAPH, spec=ToySpec, frontend="m:F",
               checkpoint_marker="config.json")
    lonely = GraphDef("lonely", stages=(_stage("only", Call),), edges=())
    assert lonely.describe() == "stages: only (step)"


def test_a_plug_in_family_registers_through_an_entry_point(monkeypatch):
    from omni_serve.graph import registry

    toy = importlib.metadata.EntryPoint(name="toy", value="tests.toy_family:FAMILY", group=registry.ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [toy] if group == registry.ENTRY_POINT_GROUP else real(group=group, **kw))
    registry.families.cache_clear()
    try:
        found = registry.families()
        assert "toy" in found and {"qwen2_5_omni", "qwen_image"} <= set(found)
        assert found["toy"].app == "tests.toy_family:build_app"
        assert registry.family("toy").graph.describe().splitlines()[-1].startswith("encode -> decode  edge encode_decode")
        with pytest.raises(ValueError, match="unknown graph 'nope'; choose one of"):
            registry.family("nope")
    finally:
        registry.families.cache_clear()


def test_the_cli_lists_families_and_shows_a_graph(capsys):
    from omni_serve.cli import main

    assert main(["graph"]) == 0
    listing = capsys.readouterr().out
    assert all(name in listing for name in families())
    assert main(["graph", "qwen2_5_omni", "--layout", "disaggregated"]) == 0
    shown = capsys.readouterr().out
    assert "thinker_prefill -> thinker_decode  edge thinker_prefill_thinker_decode: PromptHandoff" in shown
    assert main(["graph", "qwen2_5_omni", "--layout", "bogus"]) == 2


# -- (2) every crossing refuses what is not its declared message ---------------------------------------------
def test_dicts_are_refused_at_every_crossing(qwen_image_tiny_dir):
    from omni_serve.families.qwen_image import FAMILY
    from omni_serve.kits.diffusion.messages import DecodeCall, FinalLatents

    spec = FAMILY.validate({"checkpoint": qwen_image_tiny_dir})
    conn = MemoryConnector()
    vae = build_runner(FAMILY, "vae", spec, connector=conn)

    async def main():
        engine = vae.make_engine()
        try:
            with pytest.raises(TypeError, match="takes DecodeCall, not dict"):  # a stage call
                [o async for o in vae.handle(engine, {"request_id": "r", "height": 64, "width": 64})]
            with pytest.raises(TypeError, match="dit_vae carries FinalLatents, not dict"):  # a payload read
                await conn.put("r/dit_vae/0", {"latents": torch.zeros(1, 16, 64)})
                await vae.io.read_one("dit_vae", "r")
            dit = build_runner(FAMILY, "dit", spec, connector=conn)
            with pytest.raises(TypeError, match="dit_vae carries FinalLatents, not dict"):  # a payload written
                await dit.io.writer("dit_vae", "r").write({"latents": torch.zeros(1)})
            with pytest.raises(ValueError, match="does not write edge 'dit_vae'"):
                vae.io.writer("dit_vae", "r")

            class Sloppy(type(vae)):  # a runner whose output is not declared
                async def run(self, engine, call):
                    yield {"images": []}
            sloppy = Sloppy(vae.graph, vae.stage, spec, vae.io)
            with pytest.raises(TypeError, match="produced a dict, not one of its declared outputs"):
                [o async for o in sloppy.handle(engine, DecodeCall(request_id="s", height=64, width=64))]
        finally:
            await engine.cleanup()
        calls = StageCalls(FAMILY.graph, spec, open_call=None, probe=None, connector=conn)
        with pytest.raises(TypeError, match="stage vae takes DecodeCall, not dict"):  # ingress -> stage
            [e async for e in calls.stream("r", {"vae": {"request_id": "r"}}, 1.0)]
        with pytest.raises(ValueError, match="writes no edge 'dit_vae'"):  # the ingress feeds no such edge
            await calls.put("r", "dit_vae", FinalLatents(latents=torch.zeros(1)))

    asyncio.run(main())


# -- (3) real traffic, recorded at every crossing --------------------------------------------------------------
class Recording(MemoryConnector):
    def __init__(self):
        super().__init__()
        self.payloads = []

    async def put(self, key, payload):
        self.payloads.append(payload)
        await super().put(key, payload)


class RecordedGraph(LocalGraph):
    def __init__(self, family, args):
        self.recorded = {"calls": [], "outputs": []}
        super().__init__(family, args, connector=Recording())

    def _open(self, stage, call):
        self.recorded["calls"].append(call)
        inner = super()._open(stage, call)
        original = inner._outputs

        async def outputs():
            async for out in original:
                self.recorded["outputs"].append(out)
                yield out
        inner._outputs = outputs()
        return inner


def _dicts_inside(obj, path="") -> list[str]:
    if isinstance(obj, dict):
        return [path or "<top>"]
    if isinstance(obj, BaseModel):
        return [p for name in type(obj).model_fields for p in _dicts_inside(getattr(obj, name), f"{path}.{name}")]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in _dicts_inside(v, f"{path}[{i}]")]
    return []


def _check_recorded(graph: RecordedGraph) -> dict[str, set[str]]:
    crossed = {"calls": graph.recorded["calls"], "outputs": graph.recorded["outputs"],
               "payloads": graph.stages.connectors[0].payloads}
    for kind, objects in crossed.items():
        assert objects, f"no {kind} crossed"
        for obj in objects:
            assert isinstance(obj, Message), f"{kind}: a {type(obj).__name__} crossed"
            assert not _dicts_inside(obj), f"{kind}: {type(obj).__name__} holds dicts at {_dicts_inside(obj)}"
    return {kind: {type(o).__name__ for o in objs} for kind, objs in crossed.items()}


def test_image_traffic_carries_only_messages(qwen_image_tiny_dir):
    from omni_serve.api.images import ImageGenerationRequest
    from omni_serve.graph.frontend import RequestContext
    from omni_serve.families.qwen_image import FAMILY

    async def main():
        graph = RecordedGraph(FAMILY, {"checkpoint": qwen_image_tiny_dir, "default_size": "64x64"})
        try:
            req = ImageGenerationRequest(prompt="a cat", negative_prompt="blur", true_cfg_scale=2.0,
                                         num_inference_steps=2, seed=1)
            response = await graph.frontend.images_generations(req, RequestContext(timeout_s=120))
            return graph, response
        finally:
            await graph.aclose()
    graph, response = asyncio.run(main())
    assert len(response.data) == 1 and response.metrics.true_cfg
    kinds = _check_recorded(graph)
    assert kinds["payloads"] == {"PromptEmbeds", "FinalLatents"}


def test_glm_image_traffic_carries_only_messages(glm_image_tiny_dir):
    from omni_serve.api.images import ImageGenerationRequest
    from omni_serve.graph.frontend import RequestContext
    from omni_serve.families.glm_image import FAMILY

    async def main():
        graph = RecordedGraph(FAMILY, {"checkpoint": glm_image_tiny_dir, "default_size": "64x64"})
        try:
            req = ImageGenerationRequest(prompt='a sign saying "hi"', guidance_scale=2.0, num_inference_steps=2, seed=1)
            return graph, await graph.frontend.images_generations(req, RequestContext(timeout_s=120))
        finally:
            await graph.aclose()
    graph, response = asyncio.run(main())
    assert len(response.data) == 1 and response.metrics.true_cfg
    kinds = _check_recorded(graph)
    assert kinds["payloads"] == {"PriorTokens", "PromptEmbeds", "FinalLatents"}


def test_edit_traffic_carries_only_messages():
    from omni_serve.graph.frontend import RequestContext
    from omni_serve.families.qwen_image_edit import FAMILY
    from tests.conftest import tiny_checkpoint
    from tests.unit.test_qwen_image_edit import ImageEditRequest, openai_mask, png, upload

    async def main():
        graph = RecordedGraph(FAMILY, {"checkpoint": tiny_checkpoint("qwen_image_edit")})
        try:
            req = ImageEditRequest.model_validate({
                "prompt": "a cat", "image": [upload(png(64, 64, 0))], "mask": upload(openai_mask(64, 64, (
                    slice(0, 32), slice(None)))), "num_inference_steps": 1, "negative_prompt": " ",
                "true_cfg_scale": 2.0, "cache[mode]": "dbcache"})
            return graph, await graph.frontend.images_edits(req, RequestContext(timeout_s=300))
        finally:
            await graph.aclose()
    graph, response = asyncio.run(main())
    assert len(response.data) == 1
    kinds = _check_recorded(graph)
    assert kinds["payloads"] == {"InputImage", "InpaintMask", "PromptEmbeds", "ConditionLatents", "FinalLatents"}


@pytest.mark.parametrize("layout", ["aggregated", "disaggregated"])
def test_omni_traffic_carries_only_messages(omni_tiny_dir, layout):
    from omni_serve.api import protocol as P
    from omni_serve.graph.frontend import RequestContext
    from omni_serve.families.qwen2_5_omni import FAMILY
    from tests.omni_cases import image, png_data_url

    async def main():
        graph = RecordedGraph(FAMILY, {"checkpoint": omni_tiny_dir, "thinker_layout": layout,
                                       "stages.talker.params.max_codec_tokens": 16,
                                       "stages.code2wav.params.num_steps": 1})
        try:
            req = P.ChatCompletionRequest(
                model="qwen2.5-omni", modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"},
                max_tokens=4, min_tokens=4, temperature=0,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(image())}},
                    {"type": "text", "text": "what is this"}]}])
            response = await graph.frontend.chat_completions(req, RequestContext(timeout_s=120))
            return graph, response
        finally:
            await graph.aclose()
    graph, response = asyncio.run(main())
    assert response.choices[0].message.audio.data
    kinds = _check_recorded(graph)
    expected = {"MediaInputs", "MediaEmbeddings", "ThinkerStates", "CodecChunk"}
    if layout == "disaggregated":
        expected.add("PromptHandoff")
    assert kinds["payloads"] == expected
    assert {"TextDelta", "CodecDelta", "AudioDelta"} <= kinds["outputs"]


def test_the_families_reference_page_is_current():
    import os

    from omni_serve.graph.docs import markdown

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "graphs.md")
    with open(path) as f:
        assert f.read() == markdown(families()), "docs/graphs.md is stale: omni-serve graph --markdown > docs/graphs.md"
