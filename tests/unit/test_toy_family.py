"""A new family is one package: ``tests/toy_family`` (its declaration, spec, messages, frontend, runners, model
adapter and checkpoint writer), registered through the ``omni_serve.families`` entry point, is listed by the
registry, gets a checkpoint from the CLI, validates, and serves a request end to end in one process (the same
runners, engines, connector and frontend a Serve deployment runs), without a line changed outside it."""

from __future__ import annotations

import ast
import asyncio
import os

import pytest

from omni_serve.api.errors import OpenAIError
from omni_serve.graph.frontend import RequestContext
from omni_serve.graph.local import LocalGraph

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "toy_family")


def _echo(graph: LocalGraph, text: str) -> str:
    from tests.toy_family.frontend import EchoRequest

    async def main():
        async with graph:
            return await graph.frontend.echo(EchoRequest(text=text), RequestContext(timeout_s=30))

    return asyncio.run(main()).text


def test_a_toy_family_plugs_in_and_serves_through_its_own_package_only(toy, tmp_path, capsys):
    from omni_serve.cli import main

    ckpt = str(tmp_path / "toy-tiny")
    assert main(["make-checkpoint", "toy", "--size", "tiny", ckpt]) in (0, None)
    spec = toy.validate({"checkpoint": ckpt})
    assert spec.stages.encode.num_cpus == 0.1  # the declaration's defaults reach the spec
    assert _echo(LocalGraph(toy, {"checkpoint": ckpt}), "hello, graph") == "hello, graph"
    with pytest.raises(OpenAIError, match="ASCII"):
        _echo(LocalGraph(toy, {"checkpoint": ckpt}), "é")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        toy.validate({"checkpoint": str(tmp_path)})


def test_the_toy_family_imports_no_shipped_family_or_kit_internals():
    found = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                tree = ast.parse(open(os.path.join(root, name)).read())
                found += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    ours = [m for m in found if m.startswith("omni_serve")]
    assert ours and not [m for m in ours if m.startswith("omni_serve.families")]
