"""The connectors of this process: one instance per backend, built on first use from the graph's settings.

Contract: ``get_connector(name, data_plane)`` returns the process-wide connector of a backend (``auto``: the
one this process chose, ``omni_serve.transport.auto``), built from its ``data_plane`` section the first time
(every process of one graph validates the same spec, so all get the same settings); ``connector_stats()``
counts what those connectors hold (``/health``); ``close_connectors()`` closes and forgets them;
``keep_node_tidy(data_plane)`` makes this process take its turns as its node's shared-memory janitor.
"""

from __future__ import annotations

import logging

from omni_serve.transport.auto import resolve
from omni_serve.transport.base import Connector
from omni_serve.transport.config import DataPlaneSpec
from omni_serve.transport.registry import connector_class

log = logging.getLogger(__name__)

_INSTANCES: dict[str, Connector] = {}


def get_connector(name: str, data_plane=None) -> Connector:
    """The process-wide connector of a backend.

    Args:
        name: an edge's ``connector``: a registered backend or ``auto``.
        data_plane: the graph's ``DataPlaneSpec`` (None: every backend's default settings).

    Returns:
        The connector, built on first use.
    """
    name = resolve(name, data_plane)
    if name not in _INSTANCES:
        data_plane = DataPlaneSpec() if data_plane is None else data_plane
        cls = connector_class(name)
        build = getattr(cls, "from_data_plane", None)  # a connector made of others (nearest) gets the whole spec
        _INSTANCES[name] = build(data_plane) if build else cls.from_settings(data_plane.section(name))
    return _INSTANCES[name]


def keep_node_tidy(data_plane=None) -> None:
    """Take this process' part in its node's shared-memory housekeeping (``SharedMemoryConnector.keep_tidy``),
    whichever backends its edges use: every stage and ingress replica calls it on its event loop when it starts,
    so a node keeps a janitor while any of them runs there. Where shared memory cannot be used (or no event loop
    runs), it logs why."""
    try:
        get_connector("shm", data_plane).keep_tidy()
    except Exception as exc:  # noqa: BLE001 - housekeeping never fails a replica's start
        log.warning("this process does not sweep its node's shared memory: %s", exc)


def built_connector(name: str) -> Connector | None:
    """The process' connector of a registered backend if it was built, else None (builds nothing)."""
    return _INSTANCES.get(name)


def connector_stats() -> dict[str, dict[str, int]]:
    """Counters of the connectors this process has built (leak checks, /health); a backend that keeps nothing
    per process (``ray``: its directory actor holds the state) is left out."""
    return {name: stats for name, c in _INSTANCES.items() if (stats := c.stats())}


def close_connectors() -> None:
    """Close every connector this process has built; the next ``get_connector`` builds a new one."""
    while _INSTANCES:
        _, connector = _INSTANCES.popitem()
        connector.close()
