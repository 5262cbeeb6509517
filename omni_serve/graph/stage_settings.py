"""Each stage's settings in its own Serve deployment, so a redeploy that changes one stage rolls only that stage.

Why: Ray Serve gives every deployment of an application the same code version, a hash of the application's
``args`` and of every deployment's autoscaling ``policy`` (``get_app_code_version``). With the whole graph spec in
``args``, changing one stage's setting restarted every stage and the ingress, and a request in flight could meet
old and new versions. What Serve keys per deployment is the config's ``deployments:`` entries: a changed
``ray_actor_options`` restarts (rolls) only that deployment; a changed ``num_replicas``, autoscaling bound or delay,
``max_ongoing_requests``, ``max_queued_requests``, ``graceful_shutdown_timeout_s`` or ``max_surge_percent`` is
applied to the running replicas without a restart. A rolling deployment starts its replacements before it stops
the old replicas (``max_surge_percent``, 100 by default), and a stopping replica finishes what it holds
(``graceful_shutdown_timeout_s``, the request deadline by default).

Contract (a Serve config file written by ``omni_serve.graph.serve_config``):
- ``args`` holds the graph-level spec and, of each stage, its engine backend (the graph's shape: a family's layout
  may follow it, and the builder decides what to deploy from it). A stage ``in_args`` (a vLLM stage whose
  interpreter comes from the cluster's ``OMNI_SERVE_VLLM_PYTHON``, which only the builder, on the cluster, can
  read) keeps its whole spec there and has no entry.
- ``deployment_entries(spec, stages)`` returns one ``deployments:`` entry per other deployed stage: its deployment
  options (``StageSpec.deployment_options``) with its ``StageSpec`` as JSON in the replica's environment
  (``STAGE_SPEC_ENV``; the in-place options left out), plus the ingress' entry, whose environment carries
  ``STAGE_VIEWS_ENV``: what the ingress reads of each of those stages (``ingress_view``: params, the engine's
  backend, KV cache and vLLM settings, and whether it may scale to zero).
- A stage replica calls ``own_stage(graph_spec, stage)`` and the ingress ``stage_views(graph_spec)``: the bound
  graph spec with the environment's stage settings in place (unchanged when the variable is absent, as under
  ``serve run module:build_app`` or the Python API, where the whole spec is bound and everything rolls).

So changing a stage's replicas, autoscaling bounds and delays, queues, surge or shutdown budget touches no
replica; its CPUs, GPUs, resources, environment, ``max_step_s``, threads, dtype or device roll that stage alone;
its ``params`` or the rest of its ``engine``, or a ``min_replicas`` to or from 0, roll that stage and the ingress
(the frontend reads them: token limits, KV capacity), never the other stages. Graph-level settings (``args``), a
stage's backend, and adding, removing or re-tuning an autoscaling ``policy`` (Serve hashes it into every
deployment's version) roll the whole graph. Each request makes one call per stage, so it meets one version of each
stage even while a stage rolls.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Iterable

STAGE_SPEC_ENV = "OMNI_SERVE_STAGE_SPEC"  # a stage replica's own StageSpec, JSON
STAGE_VIEWS_ENV = "OMNI_SERVE_STAGE_VIEWS"  # {stage: ingress_view}, JSON, in the ingress' environment
# StageSpec fields that are Serve deployment options Serve changes in place: kept out of the replica's
# environment (where a change would restart it); no replica reads them.
IN_PLACE_FIELDS = frozenset({"num_replicas", "autoscaling_config", "max_ongoing_requests", "max_queued_requests",
                             "graceful_shutdown_timeout_s", "max_surge_percent"})
# Engine settings only the stage's replicas read (left out of the ingress' view, so changing them rolls no ingress).
REPLICA_ONLY_ENGINE_FIELDS = frozenset({"max_active_requests", "torch_threads", "dtype", "device"})


def in_args(stage_spec: Any) -> bool:
    """Whether a stage's settings must stay in ``args``: its replica options depend on the cluster (a vLLM stage
    whose interpreter is the cluster's ``OMNI_SERVE_VLLM_PYTHON``; name it in ``engine.vllm.python`` to give the
    stage its own entry)."""
    return stage_spec.engine.backend == "vllm" and not stage_spec.engine.vllm.python


def ingress_view(stage_spec: Any) -> dict[str, Any]:
    """What the ingress reads of a stage's spec (``StageSpec``): its params and engine settings, and
    whether its autoscaling may take it to zero replicas (then it never counts as missing)."""
    auto = stage_spec.autoscaling_config or {}
    dumped = stage_spec.model_dump(mode="json")
    engine = {k: v for k, v in dumped["engine"].items() if k not in REPLICA_ONLY_ENGINE_FIELDS}
    view = {"params": dumped["params"], "engine": engine}
    if auto.get("min_replicas", 1) == 0:
        view["scales_to_zero"] = True
    return view


def _with_env(options: dict[str, Any], name: str, value: dict[str, Any]) -> dict[str, Any]:
    actor = options.setdefault("ray_actor_options", {})
    runtime_env = actor.setdefault("runtime_env", {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), name: json.dumps(value, sort_keys=True)}
    return options


def deployment_entries(spec: Any, stages: Iterable[str]) -> list[dict[str, Any]]:
    """The ``deployments:`` entries of a Serve config: every deployed stage's, then the ingress'."""
    entries, views = [], {}
    for stage in stages:
        stage_spec = spec.stage_spec(stage)
        if in_args(stage_spec):
            continue
        options = copy.deepcopy(stage_spec.deployment_options(stage, spec.ingress.request_timeout_s))
        entries.append(_with_env(options, STAGE_SPEC_ENV, stage_spec.model_dump(mode="json", exclude=IN_PLACE_FIELDS)))
        views[stage] = ingress_view(stage_spec)
    ing = spec.ingress
    actor = {"num_cpus": ing.num_cpus, **({"resources": dict(ing.resources)} if ing.resources else {})}
    entries.append(_with_env({"name": "ingress", "ray_actor_options": actor}, STAGE_VIEWS_ENV, views))
    return entries


def own_stage(graph_spec: dict[str, Any], stage: str) -> dict[str, Any]:
    """``graph_spec`` with this stage replica's settings from its environment, if there are any."""
    raw = os.environ.get(STAGE_SPEC_ENV)
    if not raw:
        return graph_spec
    out = copy.deepcopy(graph_spec)
    stages = out.setdefault("stages", {})
    stages[stage] = {**{k: v for k, v in stages.get(stage, {}).items() if k in IN_PLACE_FIELDS}, **json.loads(raw)}
    return out


def stage_views(graph_spec: dict[str, Any]) -> dict[str, Any]:
    """``graph_spec`` with the stage settings the ingress reads, from its environment, if there are any."""
    raw = os.environ.get(STAGE_VIEWS_ENV)
    if not raw:
        return graph_spec
    out = copy.deepcopy(graph_spec)
    stages = out.setdefault("stages", {})
    for stage, view in json.loads(raw).items():
        entry = stages.setdefault(stage, {})
        entry["params"] = view["params"]
        entry["engine"] = {**entry.get("engine", {}), **view["engine"]}
        if view.get("scales_to_zero"):
            entry["num_replicas"] = None
            entry["autoscaling_config"] = {"min_replicas": 0, "max_replicas": 1}
        else:
            entry.pop("autoscaling_config", None)
    return out


def config_graph_spec(app: dict[str, Any]) -> dict[str, Any]:
    """The whole graph spec an application entry of a Serve config file deploys: its ``args`` plus each stage's
    settings from its ``deployments`` entry (tests, operators)."""
    spec = copy.deepcopy(app.get("args") or {})
    for entry in app.get("deployments") or []:
        raw = (((entry.get("ray_actor_options") or {}).get("runtime_env") or {}).get("env_vars") or {}).get(
            STAGE_SPEC_ENV)
        if raw:
            options = {k: entry[k] for k in IN_PLACE_FIELDS if k in entry}
            if "autoscaling_config" in options:
                options["num_replicas"] = None
            spec.setdefault("stages", {})[entry["name"]] = {**json.loads(raw), **options}
    return spec
