"""Defaults sized to the cluster when a graph is built, so that what a user gets without tuning is what the
benchmarks report.

Contract: a family may name a sizing rule (``Family.sizing``: "module:function", imported only when a graph is
built). The rule takes the spec of the user's values and the cluster's ``ClusterShape`` and returns nested defaults
(``{"stages": {"code2wav": {"num_replicas": 2}}}``) that depend on the cluster. ``sized_spec(family, args, shape)``
validates ``args`` over those defaults: every key the user gave (Python, a YAML file, the command line) wins over
the rule's. It returns the spec and what the rule decided that the user did not set (dotted key -> value), which the
builder logs. ``sizing: off`` in a graph's spec keeps the static defaults.

``ClusterShape.detect()`` sees the Ray cluster this process is connected to (``omni-serve serve`` and a Serve config
deployment build the graph there), or this machine when it is not connected: ``serve run module:build_app`` builds
the application before it starts or joins Ray, and on one machine that is the cluster it starts. A cluster that
autoscales its nodes is sized by the nodes it has when the graph is built.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from omni_serve.graph.spec import GraphSpecBase, apply_overrides, merge

if TYPE_CHECKING:
    from omni_serve.graph.family import Family

log = logging.getLogger(__name__)

SizingRule = Callable[[GraphSpecBase, "ClusterShape"], dict[str, Any]]


@dataclass(frozen=True)
class ClusterShape:
    cpus: float  # logical CPUs of the cluster (Ray's CPU resource)
    source: str  # where the number comes from, for the log

    @classmethod
    def detect(cls) -> "ClusterShape":
        import ray

        if ray.is_initialized():
            return cls(float(ray.cluster_resources().get("CPU", 0.0)), "the Ray cluster")
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cls(float(cpus), "this machine (no Ray connection yet)")


def rule_for(path: str) -> SizingRule:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def sized_spec(family: "Family", args: dict[str, Any] | None,
               shape: ClusterShape | None = None) -> tuple[GraphSpecBase, dict[str, Any]]:
    """The validated spec of ``args`` with the family's sizing rule under them, and what the rule set (dotted key
    -> value, the keys the user did not give)."""
    spec = family.validate(args)
    if family.sizing is None or spec.sizing == "off":
        return spec, {}
    shape = shape or ClusterShape.detect()
    defaults = rule_for(family.sizing)(spec, shape)
    given = flatten(apply_overrides(dict(args or {})))
    decided = {key: value for key, value in flatten(defaults).items()
               if not any(key == g or key.startswith(g + ".") for g in given)}
    if not decided:
        return spec, {}
    sized = family.validate(merge(apply_overrides(dict(decided)), apply_overrides(dict(args or {}))))
    log.info("%s sized to %s (%g CPUs): %s", family.name, shape.source, shape.cpus,
             ", ".join(f"{k}={v}" for k, v in decided.items()))
    return sized, decided
