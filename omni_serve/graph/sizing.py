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
the application before it starts Ray, and on one machine that is the cluster it starts (Ray's own count, which
honours a container's CPU quota). When ``RAY_ADDRESS`` names a cluster this process has not joined yet, it cannot
see it, and nothing is sized (logged). A cluster that autoscales its nodes is sized by the nodes it has when the
graph is built.

A Serve config file (``omni_serve.graph.serve_config``) is written away from the cluster: ``left_to_cluster``
names the options the rule decides that the user did not set, and the writer leaves them out of the ``deployments``
entries, so that the builder, on the cluster, sizes them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omni_serve.graph.registry import import_path
from omni_serve.graph.spec import GraphSpecBase, apply_overrides, merge

if TYPE_CHECKING:
    from omni_serve.graph.family import Family

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ClusterShape:
    cpus: float  # logical CPUs of the cluster (Ray's CPU resource)
    source: str  # where the number comes from, for the log

    @classmethod
    def detect(cls) -> "ClusterShape | None":
        """The cluster's shape, or None when it cannot be seen from here (``RAY_ADDRESS`` set, not joined)."""
        import ray

        if ray.is_initialized():
            return cls(float(ray.cluster_resources().get("CPU", 0.0)), "the Ray cluster")
        if os.environ.get("RAY_ADDRESS", "local") not in ("", "local"):
            return None
        try:  # what ray.init gives a local node: cgroup-aware (a container's quota), unlike os.sched_getaffinity
            from ray._private.utils import get_num_cpus

            cpus = float(get_num_cpus())
        except Exception:  # noqa: BLE001 - a Ray without it: the CPUs this process may run on
            cpus = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
        return cls(cpus, "this machine (no Ray connection yet)")


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _decided(family: "Family", spec: GraphSpecBase, args: dict[str, Any] | None,
             shape: ClusterShape) -> dict[str, Any]:
    """What the family's rule sets for ``shape`` that the user did not give (dotted key -> value)."""
    if family.sizing is None or spec.sizing == "off":
        return {}
    defaults = import_path(family.sizing)(spec, shape)
    given = flatten(apply_overrides(dict(args or {})))
    return {key: value for key, value in flatten(defaults).items()
            if not any(key == g or key.startswith(g + ".") for g in given)}


def sized_spec(family: "Family", args: dict[str, Any] | None,
               shape: ClusterShape | None = None) -> tuple[GraphSpecBase, dict[str, Any]]:
    """The validated spec of ``args`` with the family's sizing rule under them, and what the rule set (dotted key
    -> value, the keys the user did not give)."""
    spec = family.validate(args)
    if family.sizing is None or spec.sizing == "off":
        return spec, {}
    shape = shape or ClusterShape.detect()
    if shape is None:
        log.info("%s not sized: RAY_ADDRESS=%s is a cluster this process has not joined; the static defaults "
                 "apply (set the values, or build where the cluster is seen)", family.name,
                 os.environ.get("RAY_ADDRESS"))
        return spec, {}
    decided = _decided(family, spec, args, shape)
    if not decided:
        return spec, {}
    sized = family.validate(merge(apply_overrides(dict(decided)), apply_overrides(dict(args or {}))))
    log.info("%s sized to %s (%g CPUs): %s", family.name, shape.source, shape.cpus,
             ", ".join(f"{k}={v}" for k, v in decided.items()))
    return sized, decided


def left_to_cluster(family: "Family", spec: GraphSpecBase, args: dict[str, Any] | None) -> set[str]:
    """The dotted keys the rule decides on the cluster for ``args`` (whatever its size) that the user left unset."""
    return set(_decided(family, spec, args, ClusterShape(1.0, "a nominal cluster")))
