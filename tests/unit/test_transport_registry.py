"""The connector registry and contract: every backend is a ``Connector`` (stats, sweep, close), names are lazy
strings, a plug-in connector's ``data_plane`` section is validated by its own ``Settings`` model, the built-in
sections keep their keys and defaults, and the transport modules import one another without a cycle (no Ray)."""

from __future__ import annotations

import ast
import asyncio
import importlib.metadata
import inspect
import os

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from omni_serve.graph.spec import apply_overrides
from omni_serve.transport import connectors, registry
from omni_serve.transport.base import Connector
from omni_serve.transport.config import DataPlaneSpec
from omni_serve.transport.memory import MemoryConnector
from omni_serve.transport.shm import SharedMemoryConnector


class ToySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    slots: int = Field(4, ge=1, description="Payloads the toy holds.")
    label: str = Field("toy", description="A name for its logs.")


class ToyConnector(MemoryConnector):
    """A plug-in with settings of its own (in-process underneath: enough for specs and the registry)."""

    name = "toy"
    scope = "cluster"
    Settings = ToySettings

    def __init__(self, section: ToySettings):
        super().__init__()
        self.section = section

    @classmethod
    def from_settings(cls, section):
        return cls(section)


class NotAConnector:
    pass


TOY = f"{__name__}:ToyConnector"


@pytest.fixture
def fresh_registry(monkeypatch):
    """The registry as it is, restored after the test (with its connectors of this process)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(connectors, "_INSTANCES", {})
    yield registry
    connectors.close_connectors()


# -- the contract ----------------------------------------------------------------------------------------------
def _built(name: str, tmp_path) -> Connector:
    cls = registry.connector_class(name)
    if cls is SharedMemoryConnector:
        return SharedMemoryConnector(tmp_path, directory=None)
    return cls.from_settings(DataPlaneSpec.model_validate(
        {"mooncake": {"buffer_bytes": 1 << 20}}).section(name))


@pytest.mark.parametrize("name", [n for n in registry.known_connectors() if n != registry.AUTO])
def test_every_registered_connector_implements_the_contract_and_closes_twice(name, tmp_path):
    cls = registry.connector_class(name)
    assert issubclass(cls, Connector) and not inspect.isabstract(cls)
    for method in ("put", "get", "free", "free_request", "sweep", "stats", "close"):
        assert getattr(cls, method) is not getattr(Connector, method), f"{name} inherits the abstract {method}"
    assert cls.Settings is None or all(f.description for f in cls.Settings.model_fields.values())
    conn = _built(name, tmp_path)
    assert isinstance(conn.stats(), dict)
    conn.close()
    conn.close()


@pytest.mark.parametrize("cls", [MemoryConnector, SharedMemoryConnector])
def test_close_drops_what_the_process_holds_and_the_connector_works_again(cls, tmp_path):
    async def main():
        conn = cls() if cls is MemoryConnector else cls(tmp_path, directory=None)
        await conn.put("r/e/0", {"x": torch.ones(4)})
        assert conn.stats()["unread"] == 1
        conn.close()
        assert conn.stats()["unread"] == 0
        if cls is SharedMemoryConnector:
            assert not any(p for p in os.listdir(conn.root / "pools") if not p.startswith("."))
        conn.close()
        await conn.put("r/e/1", {"x": torch.ones(4)})
        assert torch.equal((await conn.get("r/e/1", 1.0))["x"], torch.ones(4))
        conn.close()

    asyncio.run(main())


def test_closing_the_mooncake_transfer_engine_unregisters_its_buffer():
    pytest.importorskip("mooncake.engine")
    from omni_serve.transport.mooncake import MooncakeSettings, MooncakeTransferConnector

    conn = MooncakeTransferConnector(MooncakeSettings(buffer_bytes=1 << 20))
    conn._ensure_started()  # local tcp, P2P handshake: no Ray, no etcd
    assert conn.pool.num_regions == 1  # the registered zero byte
    conn.close()
    conn.close()
    assert conn.engine is None and conn.pool.num_regions == 0 and conn.stats() == {"regions": 0, "used_bytes": 0}


# -- names -----------------------------------------------------------------------------------------------------
def test_a_connector_registered_by_name_is_known_and_imported_on_first_use(fresh_registry):
    registry.register_connector("toy", TOY)
    assert "toy" in registry.known_connectors() and "auto" in registry.known_connectors()
    assert registry.connector_class("toy") is ToyConnector
    assert "toy" in registry.served_connectors() and "memory" not in registry.served_connectors()


def test_the_registry_refuses_unknown_names_auto_and_bad_registrations(fresh_registry):
    with pytest.raises(ValueError, match="unknown connector 'nvlink'; registered connectors: auto, memory, "):
        registry.connector_class("nvlink")
    with pytest.raises(ValueError, match="'auto' names no connector class"):
        registry.connector_class("auto")
    with pytest.raises(ValueError, match="cannot name a connector"):
        registry.register_connector("auto", TOY)
    with pytest.raises(ValueError, match="is not 'package.module:Class'"):
        registry.register_connector("toy", "tests.unit.test_transport_registry.ToyConnector")
    registry.register_connector("gone", "no_such_package.connector:Gone")
    with pytest.raises(ValueError, match="connector 'gone' is registered as 'no_such_package.connector:Gone', "
                                         "which cannot be imported"):
        registry.connector_class("gone")
    registry.register_connector("plain", f"{__name__}:NotAConnector")
    with pytest.raises(ValueError, match="is not a subclass of omni_serve.transport.base.Connector"):
        registry.connector_class("plain")


# -- data_plane sections ---------------------------------------------------------------------------------------
def test_a_plug_in_connector_takes_settings_validated_by_its_own_model(fresh_registry):
    from omni_serve.graph.family import Family
    from tests.toy_family import GRAPH, ToySpec

    registry.register_connector("toy", TOY)
    family = Family(name="toy", module="tests.toy_family", description="x", graph=GRAPH, spec=ToySpec,
                    frontend="tests.toy_family:ToyFrontend", checkpoint_marker="config.json")
    spec = family.parse({"checkpoint": "x", "edges.encode_decode.connector": "toy", "data_plane.toy.slots": 9})
    assert spec.data_plane.section("toy") == ToySettings(slots=9)
    conn = connectors.get_connector(spec.edges.encode_decode.connector, spec.data_plane)
    assert isinstance(conn, ToyConnector) and conn.section.slots == 9
    assert connectors.get_connector("toy") is conn  # one per process
    assert connectors.connector_stats() == {"toy": {"unread": 0}}
    assert DataPlaneSpec().section("toy") == ToySettings()  # left out: the model's defaults
    with pytest.raises(ValidationError) as info:
        family.parse({"checkpoint": "x", "data_plane.toy.slots": 0, "data_plane.toy.colour": "red"})
    assert {e["loc"] for e in info.value.errors()} == {("data_plane", "toy", "slots"), ("data_plane", "toy", "colour")}


def test_a_connector_of_the_entry_point_group_takes_settings(fresh_registry, monkeypatch):
    toy = importlib.metadata.EntryPoint(name="toy_ep", value=TOY, group=registry.ENTRY_POINT_GROUP)
    real = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None, **kw: [toy] if group == registry.ENTRY_POINT_GROUP else real(group=group, **kw))
    monkeypatch.setattr(registry, "_entry_points_read", False)
    assert DataPlaneSpec.model_validate({"toy_ep": {"label": "x"}}).section("toy_ep") == ToySettings(label="x")


@pytest.mark.parametrize("key, error", [
    ("nvlink", "unknown connector 'nvlink'; registered connectors: auto, memory"),
    ("ray", "connector 'ray' takes no settings"),
    ("auto", "'auto' names no connector class"),
    ("mooncake_store", "connector 'mooncake_store' reads its settings from data_plane.mooncake"),
])
def test_a_section_no_connector_reads_is_refused(key, error):
    with pytest.raises(ValidationError, match=error) as info:
        DataPlaneSpec.model_validate({key: {}})
    assert info.value.errors()[0]["loc"] == (key,)


def test_the_built_in_sections_keep_their_keys_and_defaults():
    defaults = DataPlaneSpec()
    assert defaults.section("shm").model_dump() == {"dir": None, "pool_bytes": None}
    assert defaults.section("mooncake").model_dump() == {
        "protocol": "tcp", "device_name": "", "local_hostname": None, "metadata_server": "P2PHANDSHAKE",
        "buffer_bytes": 512 << 20, "master_address": None, "global_segment_bytes": 512 << 20,
        "local_buffer_bytes": 64 << 20, "master_port": 50051}
    assert defaults.section("mooncake_store") == defaults.section("mooncake")
    assert defaults.section("ray") is None and defaults.section("memory") is None
    given = DataPlaneSpec.model_validate(apply_overrides({
        "shm.dir": "/mnt/shm", "shm.pool_bytes": 1 << 30, "mooncake.protocol": "rdma", "mooncake.master_port": 6000}))
    assert (given.shm.dir, given.shm.pool_bytes) == ("/mnt/shm", 1 << 30)
    assert given.section("mooncake_store") is given.mooncake
    assert (given.mooncake.protocol, given.mooncake.master_port, given.mooncake.buffer_bytes) == ("rdma", 6000, 512 << 20)
    assert DataPlaneSpec.model_validate(given.model_dump()) == given  # a written Serve config validates again
    for bad in ({"shm": {"pool_bytes": 1024}}, {"mooncake": {"protocol": "udp"}}, {"shm": {"size": 1}}):
        with pytest.raises(ValidationError):
            DataPlaneSpec.model_validate(bad)


def test_the_shm_section_builds_the_shm_connector(tmp_path, monkeypatch):
    monkeypatch.setattr(connectors, "_INSTANCES", {})
    spec = DataPlaneSpec.model_validate({"shm": {"dir": str(tmp_path), "pool_bytes": 2 << 20}})
    conn = connectors.get_connector("shm", spec)
    assert conn.root.parent == tmp_path and conn.pool_bytes == 2 << 20
    connectors.close_connectors()
    assert connectors._INSTANCES == {}


# -- no cycle --------------------------------------------------------------------------------------------------
def test_the_transport_modules_import_one_another_without_a_cycle():
    """base < registry < (config, auto) < connectors: function-level imports count."""
    package = os.path.dirname(inspect.getfile(registry))
    graph = {}
    for name in os.listdir(package):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(package, name)).read())
            graph[name[:-3]] = {
                m for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(
                    "omni_serve.transport")
                for m in ([a.name for a in n.names] if n.module == "omni_serve.transport" else [n.module.split(".")[2]])}

    def reaches(src: str, dst: str, seen: set) -> bool:
        return any(m == dst or (m not in seen and reaches(m, dst, seen | {m})) for m in graph.get(src, ()))

    assert not [m for m in graph if reaches(m, m, set())]
    assert not reaches("registry", "auto", set()) and not reaches("base", "registry", set())
