"""Stage placement on the chart's worker groups: every stage schedulable at its max replicas (custom
resources declared, GPUs where GPU stages land, capacity) and shm edges only inside one pod."""

from __future__ import annotations

from collections import defaultdict

import pytest

from omni_serve.graph.spec import StageSpec

from tests.unit.helm_chart_support import (
    CASES,
    _deployed,
    _graph_spec,
    _groups,
    _load_values,
    _rayservice,
    _render,
)

# ------------------------------------------------------------------------------------------- placement


def _group_capacity(group: dict, is_head: bool) -> dict[str, float]:
    """Ray resources of one pod of a group, derived the way the Ray autoscaler derives them."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    resources = dict(_get_ray_resources_from_group_spec(group, is_head))
    resources.pop("memory", None)
    return resources


def _pods(rs: dict, group: dict) -> int:
    if group["groupName"] == "head":
        return 1
    autoscaled = rs["spec"]["rayClusterConfig"].get("enableInTreeAutoscaling", False)
    return group["maxReplicas"] if autoscaled else group["replicas"]


def _demand(stage: StageSpec) -> dict[str, float]:
    return {"CPU": stage.num_cpus, "GPU": stage.num_gpus, **stage.resources}


def _max_replicas(stage: StageSpec) -> int:
    return stage.autoscaling_config["max_replicas"] if stage.autoscaling_config else stage.num_replicas


def _fits(demand: dict[str, float], capacity: dict[str, float]) -> bool:
    return all(amount <= capacity.get(name, 0) + 1e-9 for name, amount in demand.items() if amount > 0)


def _placement(render):
    """(spec, {stage: [candidate group names]}, {group: (per-pod capacity, pods, has nvidia.com/gpu)})."""
    rs = _rayservice(render)
    groups = {}
    for group in _groups(rs):
        limits = group["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        groups[group["groupName"]] = (_group_capacity(group, group["groupName"] == "head"), _pods(rs, group),
                                      "nvidia.com/gpu" in limits)
    spec = _graph_spec(render)
    candidates = {stage: [name for name, (capacity, _, _) in groups.items()
                          if _fits(_demand(getattr(spec.stages, stage)), capacity)]
                  for stage in _deployed(spec)}
    return spec, candidates, groups


def _check_schedulable(render) -> None:
    spec, candidates, groups = _placement(render)
    declared = {name for capacity, _, _ in groups.values() for name in capacity}
    for stage, where in candidates.items():
        settings = getattr(spec.stages, stage)
        missing = set(settings.resources) - declared
        assert not missing, f"stage {stage} asks for {missing}, which no worker group declares (rayResources)"
        assert where, f"stage {stage} ({_demand(settings)}) fits in no pod of {list(groups)}"
        if settings.num_gpus > 0:
            assert all(groups[g][2] for g in where), f"GPU stage {stage} may land on a group without nvidia.com/gpu"
        # A replica on a GPU reserves one and uses it; a cuda engine without a GPU reservation sees none.
        assert (settings.num_gpus > 0) == settings.engine.device.startswith("cuda"), stage
    ingress = {"CPU": spec.ingress.num_cpus}
    assert any(_fits(ingress, capacity) for capacity, _, _ in groups.values()), "no pod has CPU for the ingress"
    # At every stage's max_replicas, the pods (at their max) hold the replicas pinned to them.
    pinned = defaultdict(list)
    for stage, where in candidates.items():
        pinned[tuple(sorted(where))].append(stage)
    for where, stages in pinned.items():
        for resource in ("CPU", "GPU"):
            need = sum(_max_replicas(getattr(spec.stages, s)) * _demand(getattr(spec.stages, s))[resource]
                       for s in stages)
            have = sum(groups[g][0].get(resource, 0) * groups[g][1] for g in where)
            assert need <= have + 1e-9, f"{stages} need {need} {resource} at max replicas; {where} have {have}"


@pytest.mark.parametrize("case", list(CASES))
def test_every_stage_is_schedulable_on_the_worker_groups(renders, case):
    _check_schedulable(renders[case])


def test_placement_check_catches_unschedulable_layouts(chart):
    """The schedulability check can fail: an undeclared resource, a GPU stage on a CPU-only group."""
    values = _load_values("values-gpu.yaml")
    values["stages"]["thinker"]["resources"] = {"omni_h100": 1}
    with pytest.raises(AssertionError, match="omni_h100"):
        _check_schedulable(_render(chart, values))
    values = _load_values("values-gpu.yaml")
    values["workerGroups"][0]["resources"]["limits"].pop("nvidia.com/gpu")
    values["workerGroups"][0]["resources"]["requests"].pop("nvidia.com/gpu")
    values["workerGroups"][0]["rayResources"]["GPU"] = "1"  # Ray told of a GPU the pod does not get
    with pytest.raises(AssertionError, match="without nvidia.com/gpu"):
        _check_schedulable(_render(chart, values))
    values = _load_values("values-gpu.yaml")
    values["workerGroups"][0]["maxReplicas"] = 2
    with pytest.raises(AssertionError, match="at max replicas"):
        _check_schedulable(_render(chart, values))


def _check_shm_edges(render) -> None:
    """`shm` needs producer and consumer on one node: both pinned to one group that has a single pod."""
    from omni_serve.graph.registry import families

    spec, candidates, groups = _placement(render)
    (graph,) = [f.graph for f in families().values() if type(spec) is f.spec]
    for link in graph.links(spec.layout()):
        edge = link.edge
        if getattr(spec.edges, edge).connector != "shm":
            continue
        involved = {link.writer, link.reader}
        assert "ingress" not in involved, f"shm edge {edge}: the ingress is not pinned to a group"
        involved &= set(candidates)
        assert involved, f"shm edge {edge} joins no deployed stages"
        where = {tuple(candidates[s]) for s in involved}
        assert len(where) == 1, f"shm edge {edge}: stages {involved} may land in different groups: {where}"
        (only,) = where
        assert len(only) == 1 and groups[only[0]][1] == 1, f"shm edge {edge}: group(s) {only} can have several pods"


@pytest.mark.parametrize("case", list(CASES))
def test_shm_edges_connect_stages_pinned_to_one_pod(renders, case):
    _check_shm_edges(renders[case])


def test_shm_check_catches_an_edge_across_pods(chart):
    values = _load_values("values-gpu.yaml")
    values["args"]["edges"]["thinker_talker"]["connector"] = "shm"  # ar-gpu scales to 8 pods
    with pytest.raises(AssertionError, match="several pods"):
        _check_shm_edges(_render(chart, values))
