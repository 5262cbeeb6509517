"""The bench registry: each model family's benchmark plug-in, found by the family's name.

Contract: a family's bench is a ``BenchPlugin`` named ``BENCH`` in ``benchmarks.<family>`` (the checkout's top-level
``benchmarks/`` folder, outside the runtime package), or registered under the ``omni_serve.benches`` entry-point
group (``[project.entry-points."omni_serve.benches"] my_model = "my_pkg.bench:BENCH"``) for a family outside this
repository. ``benches()`` maps each registry family (``omni_serve.graph.registry.families``) that has a bench to
its plug-in, so ``omni-serve bench --graph <family>`` needs no CLI edit for a new family. Importing a plug-in must
stay light (no torch, no model code): its ``add_arguments`` and ``run`` import what they need when called.

``benchmarks`` is importable when the checkout's root is on ``sys.path`` (tests and ``python -m`` from the root);
otherwise (the ``omni-serve`` console script of an editable install) the root is found beside the ``omni_serve``
package or in the working directory, and put on ``sys.path`` once.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

BENCHMARKS_PACKAGE = "benchmarks"
ENTRY_POINT_GROUP = "omni_serve.benches"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchPlugin:
    family: str  # the registry family it benchmarks (``omni-serve bench --graph <family>``)
    modes: dict[str, str]  # mode -> one line of help; the first is the family's default mode
    add_arguments: Callable[[argparse.ArgumentParser], None]  # the family's own flags (one argument group)
    run: Callable[[argparse.Namespace], int]  # runs ``args.mode``; the exit status of ``omni-serve bench``
    default_for: tuple[str, ...] = field(default=())  # modes it runs when neither --graph nor the checkpoint names one

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError(f"the {self.family} bench declares no mode")


def _benchmarks_importable() -> bool:
    if importlib.util.find_spec(BENCHMARKS_PACKAGE) is not None:
        return True
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source checkout
    for root in (here, os.getcwd()):
        if os.path.isfile(os.path.join(root, BENCHMARKS_PACKAGE, "__init__.py")):
            sys.path.append(root)
            return True
    return False


def _check(obj, where: str, family: str | None = None) -> BenchPlugin:
    if not isinstance(obj, BenchPlugin):
        raise TypeError(f"{where}: BENCH must be an omni_serve.bench.plugins.BenchPlugin, not {type(obj).__name__}")
    if family is not None and obj.family != family:
        raise ValueError(f"{where} declares the bench of {obj.family!r}, not of {family!r}")
    return obj


@functools.cache
def benches() -> dict[str, BenchPlugin]:
    from omni_serve.graph.registry import families

    found: dict[str, BenchPlugin] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            plugin = _check(entry.load(), entry.value)
        except Exception:  # noqa: BLE001 - one broken plug-in must not hide the others
            log.exception("bench entry point %s = %s failed to load", entry.name, entry.value)
            continue
        found[plugin.family] = plugin
    shipped = _benchmarks_importable()
    for name in families():
        if name in found or not shipped:
            continue
        module = f"{BENCHMARKS_PACKAGE}.{name}"
        if importlib.util.find_spec(module) is not None:
            found[name] = _check(getattr(importlib.import_module(module), "BENCH"), module, family=name)
    known = families()
    return {name: plugin for name, plugin in sorted(found.items()) if name in known}


def modes() -> list[str]:
    """Every mode of every bench, in order of first appearance."""
    return list(dict.fromkeys(mode for plugin in benches().values() for mode in plugin.modes))


def checkpoint_family(checkpoint: str | None) -> str | None:
    """The family a checkpoint written by ``omni-serve make-checkpoint`` names (its omni_serve_checkpoint.json)."""
    import json

    if not checkpoint:
        return None
    try:
        with open(os.path.join(checkpoint, "omni_serve_checkpoint.json")) as f:
            return json.load(f).get("family")
    except (OSError, ValueError, AttributeError):
        return None


def resolve(graph: str | None, mode: str | None, checkpoint: str | None = None,
            default_graph: str = "qwen2_5_omni") -> BenchPlugin:
    """The plug-in to run: ``graph``'s; without one, the family the checkpoint names if its bench has ``mode``, else
    the one bench that has ``mode``, else the bench that declares itself the default for it; with neither graph nor
    mode, ``default_graph``'s. ``ValueError`` says what to pass instead."""
    known = benches()
    if graph is None and mode is None:
        graph = default_graph
    if graph is not None:
        if graph not in known:
            listed = ", ".join(known) or "none (run omni-serve bench in the checkout: benchmarks/ holds them)"
            raise ValueError(f"no bench for graph {graph!r}; benches: {listed}")
        plugin = known[graph]
        if mode is not None and mode not in plugin.modes:
            raise ValueError(f"the {graph} bench has no mode {mode!r}; its modes: {', '.join(plugin.modes)}")
        return plugin
    named = checkpoint_family(checkpoint)
    if named in known and mode in known[named].modes:
        return known[named]
    offering = [p for p in known.values() if mode in p.modes]
    defaults = [p for p in offering if mode in p.default_for]
    if len(offering) == 1 or len(defaults) == 1:
        return offering[0] if len(offering) == 1 else defaults[0]
    if not offering:
        raise ValueError(f"no bench has the mode {mode!r}; modes: {', '.join(modes())}")
    raise ValueError(f"several benches have the mode {mode!r} ({', '.join(p.family for p in offering)}): "
                     "name one with --graph")
