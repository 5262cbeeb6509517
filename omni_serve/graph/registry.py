"""The one registry of model families: the CLI (serve, build, make-checkpoint, graph), the Serve config writer
and the docs read it.

Contract: ``families()`` maps each family name to its ``Family``. Families are found by scanning the packages of
``omni_serve.families`` for a ``FAMILY`` attribute, plus any package registered under the ``omni_serve.families``
entry-point group (``[project.entry-points."omni_serve.families"] my_model = "my_pkg.my_model:FAMILY"``), so a
family outside this repository plugs in without editing it. ``family(name)`` raises ``ValueError`` naming the
known families; ``load_family(path)`` imports one family by its ``module:FAMILY`` path (what replicas get);
``import_path("module:attr")`` is how declarations' runner, adapter and frontend paths are resolved.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import pkgutil

from omni_serve.graph.family import Family

ENTRY_POINT_GROUP = "omni_serve.families"
SHIPPED = "omni_serve.families"  # scanned by name: the framework never imports a family statically
log = logging.getLogger(__name__)


@functools.cache
def families() -> dict[str, Family]:
    package = importlib.import_module(SHIPPED)
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.ispkg:
            _add(found, getattr(importlib.import_module(f"{package.__name__}.{info.name}"), "FAMILY", None),
                 info.name)
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            _add(found, entry.load(), entry.value)
        except Exception:  # noqa: BLE001 - one broken plug-in must not hide the others
            log.exception("family entry point %s = %s failed to load", entry.name, entry.value)
    return dict(sorted(found.items()))


def _add(found: dict[str, Family], obj, where: str) -> None:
    if obj is None:
        return
    if not isinstance(obj, Family):
        raise TypeError(f"{where}: FAMILY must be an omni_serve.graph.family.Family, not {type(obj).__name__}")
    if obj.name in found and found[obj.name] is not obj:
        raise ValueError(f"two families are named {obj.name!r} ({found[obj.name].module}, {obj.module})")
    found[obj.name] = obj


def family(name: str) -> Family:
    known = families()
    if name not in known:
        raise ValueError(f"unknown graph {name!r}; choose one of {sorted(known)}")
    return known[name]


def import_path(path: str):
    """The object at ``module:attribute``."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_family(path: str) -> Family:
    obj = import_path(path if ":" in path else f"{path}:FAMILY")
    if not isinstance(obj, Family):
        raise TypeError(f"{path} is not a Family")
    return obj
