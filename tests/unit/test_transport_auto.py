"""The ``auto`` connector (every edge's default): which backend it chooses and why (``nearest`` wherever Ray runs,
shared memory or Mooncake/Ray for one process), that the choice is made once per process, and that the Serve
builder's spec carries concrete backends only (no Ray: whether Ray is up is faked)."""

from __future__ import annotations

import pytest

from omni_serve.transport import auto
from omni_serve.transport.registry import connector_class, known_connectors


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(auto.ENV, raising=False)
    auto.reset()
    yield
    auto.reset()


def cluster(monkeypatch, nodes: int | None, mooncake: bool = True) -> None:
    monkeypatch.setattr(auto, "alive_nodes", lambda: nodes)
    monkeypatch.setattr(auto, "mooncake_loads", lambda: mooncake)


def test_auto_is_a_known_name_and_every_edge_defaults_to_it():
    from omni_serve.graph.spec import EdgeSpec

    assert "auto" in known_connectors()
    assert EdgeSpec().connector == "auto"


def test_one_process_with_room_in_shared_memory_chooses_shm(monkeypatch, tmp_path):
    cluster(monkeypatch, None)
    monkeypatch.setattr(auto.settings, "SHM_DIR", str(tmp_path))
    choice = auto.choose()
    assert choice.name == "shm" and str(tmp_path) in choice.reason
    assert connector_class(auto.resolve("auto")).name == "shm"


@pytest.mark.parametrize("nodes", [1, 3])
def test_a_ray_cluster_of_any_size_chooses_nearest(monkeypatch, nodes):
    """Per stream at run time (omni_serve.transport.nearest): a cluster that grows or shrinks keeps working."""
    cluster(monkeypatch, nodes)
    choice = auto.choose()
    assert choice.name == "nearest" and f"{nodes} alive node(s)" in choice.reason
    assert connector_class(choice.name).scope == "cluster"


def test_one_node_without_room_in_shared_memory_does_not_choose_shm(monkeypatch, tmp_path):
    """A container's default 64 MiB /dev/shm: shared memory would fail the first big payload."""
    cluster(monkeypatch, None, mooncake=False)

    class Small:
        f_bavail, f_frsize = 64 << 8, 4096  # 64 MiB

    monkeypatch.setattr(auto.os, "statvfs", lambda path: Small)
    choice = auto.choose(_data_plane(str(tmp_path)))
    assert choice.name == "ray" and "64 MiB free" in choice.reason
    assert auto.choose(_data_plane(str(tmp_path / "missing"))).reason.endswith(
        "is not a directory; Mooncake is not installed, the Ray object store reaches every node")


def test_the_environment_names_the_backend_and_a_bad_name_fails(monkeypatch):
    cluster(monkeypatch, 1)
    monkeypatch.setenv(auto.ENV, "ray")
    assert auto.choose().name == "ray" and auto.can_choose_for_cluster()
    monkeypatch.setenv(auto.ENV, "nvlink")
    with pytest.raises(ValueError, match="OMNI_SERVE_AUTO_CONNECTOR='nvlink' is not a connector"):
        auto.choose()


def test_the_choice_is_made_once_per_process(monkeypatch, tmp_path):
    monkeypatch.setattr(auto.settings, "SHM_DIR", str(tmp_path))
    cluster(monkeypatch, None)
    assert auto.resolve("auto") == "shm"
    cluster(monkeypatch, 2)  # Ray came up: this process keeps its choice
    assert auto.resolve("auto") == "shm"
    assert auto.resolve("shm") == "shm"


def test_builder_spec_names_concrete_backends_only_when_it_sees_the_cluster(monkeypatch, omni_tiny_dir):
    from omni_serve.families.qwen2_5_omni import FAMILY

    spec = FAMILY.validate({"checkpoint": omni_tiny_dir, "edges.thinker_talker.connector": "ray"})
    cluster(monkeypatch, None)  # a builder without Ray (serve run module:app): the replicas choose
    assert FAMILY.resolve_connectors(spec) is spec
    cluster(monkeypatch, 4)
    resolved = FAMILY.resolve_connectors(spec)
    edges = {name: getattr(resolved.edges, name) for name in type(resolved.edges).model_fields}
    assert edges["thinker_talker"].connector == "ray"  # named: kept
    assert {e.connector for n, e in edges.items() if n != "thinker_talker"} == {"nearest"}
    assert edges["talker_code2wav"].chunk_size == spec.edges.talker_code2wav.chunk_size  # the rest kept


def _data_plane(directory: str):
    from omni_serve.transport.config import DataPlaneSpec

    return DataPlaneSpec.model_validate({"shm": {"dir": directory}})
