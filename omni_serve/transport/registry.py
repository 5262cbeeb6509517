"""The connector registry: backend names to ``module:Class`` strings, imported only when a name is used.

Contract:
- A name is registered lazily, as a string: the built-in backends below, those of the ``omni_serve.connectors``
  entry-point group (``name = "package.module:Class"``; read the first time the registry is asked, so every
  process of a deployed graph sees them), and ``register_connector`` (this process only: tests, in-process
  graphs). Optional dependencies (Mooncake, Ray) load only where an edge or a ``data_plane`` section names
  their backend. A name registered first keeps its class (an entry point cannot replace a built-in).
- ``known_connectors()``: every name an edge's ``connector`` may take, the registered ones and ``auto`` (which
  names no class: ``omni_serve.transport.auto`` resolves it to one of them). ``check_connector(name)`` and
  ``connector_class(name)`` raise one ``ValueError`` for any other name, listing the known ones.
- ``connector_class(name)`` imports the class (a ``omni_serve.transport.base.Connector``), whose ``Settings`` and
  ``settings_section`` say what ``data_plane`` section it reads; ``served_connectors()``: the registered names
  whose payloads cross processes, i.e. those a deployed graph may use.
- This module imports nothing of the transport layer but the contract (``base``): ``auto`` and the process'
  instances (``connectors``) import it, never the reverse.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from omni_serve.transport.base import Connector

AUTO = "auto"  # every edge's default; a choice among the registered backends, not one of them
ENTRY_POINT_GROUP = "omni_serve.connectors"

_REGISTRY: dict[str, str] = {
    "ray": "omni_serve.transport.ray_store:RayObjectStoreConnector",
    "shm": "omni_serve.transport.shm:SharedMemoryConnector",
    "mooncake": "omni_serve.transport.mooncake:MooncakeTransferConnector",
    "mooncake_store": "omni_serve.transport.mooncake:MooncakeStoreConnector",
    "memory": "omni_serve.transport.memory:MemoryConnector",
    "nearest": "omni_serve.transport.nearest:NearestConnector",
}
_entry_points_read = False


def _registry() -> dict[str, str]:
    """The registry, with the entry points of ``ENTRY_POINT_GROUP`` added the first time it is read."""
    global _entry_points_read
    if not _entry_points_read:
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
            _REGISTRY.setdefault(entry.name, entry.value)
        _entry_points_read = True
    return _REGISTRY


def register_connector(name: str, path: str) -> None:
    """Register a backend in this process; its module is imported only when the name is first used. A deployed
    graph's processes each validate their spec: register there through the entry-point group instead.

    Args:
        name: the name edges (``edges.<edge>.connector``) and ``data_plane.<name>`` use; not ``auto``.
        path: ``"package.module:Class"`` of a ``Connector`` subclass.
    """
    if name == AUTO or not name:
        raise ValueError(f"{name!r} cannot name a connector")
    module, _, cls = path.partition(":")
    if not module or not cls:
        raise ValueError(f"connector {name!r}: {path!r} is not 'package.module:Class'")
    _REGISTRY[name] = path


def known_connectors() -> list[str]:
    """Every name an edge's ``connector`` may take: the registered backends and ``auto``, sorted."""
    return sorted([*_registry(), AUTO])


def check_connector(name: str) -> str:
    """``name`` when it is a known connector name, else a ``ValueError`` that lists the known ones."""
    if name != AUTO and name not in _registry():
        raise ValueError(f"unknown connector {name!r}; registered connectors: {', '.join(known_connectors())}")
    return name


def connector_class(name: str) -> type[Connector]:
    """The class registered under ``name``, its module imported.

    Args:
        name: a registered backend's name (``auto`` is not one: resolve it first, ``omni_serve.transport.auto``).

    Returns:
        The ``Connector`` subclass. ``ValueError`` for an unknown name, ``auto``, or a registration whose class
        cannot be imported or is no ``Connector``.
    """
    if check_connector(name) == AUTO:
        raise ValueError("'auto' names no connector class of its own: resolve it first (omni_serve.transport.auto)")
    path = _registry()[name]
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"connector {name!r} is registered as {path!r}, which cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Connector)):
        raise ValueError(f"connector {name!r}: {path} is not a subclass of omni_serve.transport.base.Connector")
    return cls


def served_connectors() -> list[str]:
    """The registered backends a deployed graph may use (their payloads cross processes), in registration
    order; imports their classes."""
    return [name for name in _registry() if connector_class(name).scope != "process"]
