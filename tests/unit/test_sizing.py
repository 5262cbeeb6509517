"""Defaults sized to the cluster (omni_serve.graph.sizing): the Qwen2.5-Omni rule, the user's values over it, and
the builder applying it."""

from __future__ import annotations

import pytest

from omni_serve.graph.registry import families
from omni_serve.graph.sizing import ClusterShape, sized_spec


def _shape(cpus: float) -> ClusterShape:
    return ClusterShape(cpus, "a test")


@pytest.mark.parametrize(("cpus", "threads", "replicas"), [(1, 1, 1), (2, 1, 2), (3.5, 1, 3), (4, 2, 2), (64, 1, 8),
                                                            (1, 2, 1)])
def test_code2wav_gets_a_replica_per_cpu_its_threads_fill(omni_tiny_dir, cpus, threads, replicas):
    args = {"checkpoint": omni_tiny_dir, "stages.code2wav.engine.torch_threads": threads}
    spec, decided = sized_spec(families()["qwen2_5_omni"], args, _shape(cpus))
    assert spec.stages.code2wav.num_replicas == replicas
    assert decided == {"stages.code2wav.num_replicas": replicas}
    assert spec.stages.talker.num_replicas == spec.stages.thinker.num_replicas == 1  # nothing else is sized
    assert spec.stages.code2wav.engine.torch_threads == threads


@pytest.mark.parametrize("given", [{"stages.code2wav.num_replicas": 3}, {"stages": {"code2wav": {"num_replicas": 3}}},
                                   {"stages.code2wav": {"num_replicas": 3}}])
def test_a_value_the_user_set_wins_over_the_rule(omni_tiny_dir, given):
    spec, decided = sized_spec(families()["qwen2_5_omni"], {"checkpoint": omni_tiny_dir, **given}, _shape(2))
    assert spec.stages.code2wav.num_replicas == 3 and decided == {}
    assert spec.stages.code2wav.num_cpus == 0.25  # the stage's own defaults stay under the user's value


def test_sizing_off_autoscaling_accelerators_and_placed_stages_keep_the_static_defaults(omni_tiny_dir):
    qwen = families()["qwen2_5_omni"]
    for value in ("off", False):  # False: YAML's reading of `sizing=off`
        off, decided = sized_spec(qwen, {"checkpoint": omni_tiny_dir, "sizing": value}, _shape(4))
        assert off.sizing == "off" and off.stages.code2wav.num_replicas == 1 and decided == {}
    scaled, decided = sized_spec(qwen, {"checkpoint": omni_tiny_dir, "stages.code2wav.autoscaling_config":
                                        {"min_replicas": 1, "max_replicas": 3}}, _shape(4))
    assert decided == {} and scaled.stages.code2wav.autoscaling_config["max_replicas"] == 3
    gpu, decided = sized_spec(qwen, {"checkpoint": omni_tiny_dir, "stages.code2wav.engine.device": "cuda"}, _shape(4))
    assert decided == {} and gpu.stages.code2wav.num_replicas == 1
    gpus, decided = sized_spec(qwen, {"checkpoint": omni_tiny_dir, "stages.code2wav.num_gpus": 1}, _shape(4))
    assert decided == {} and gpus.stages.code2wav.num_replicas == 1
    placed, decided = sized_spec(qwen, {"checkpoint": omni_tiny_dir, "stages.code2wav.resources": {"speech": 1}},
                                 _shape(4))
    assert decided == {} and placed.stages.code2wav.num_replicas == 1
    with pytest.raises(ValueError, match="sizing"):
        sized_spec(qwen, {"checkpoint": omni_tiny_dir, "sizing": "on"}, _shape(4))


def test_families_without_a_rule_are_not_sized(qwen3_omni_tiny_dir):
    spec, decided = sized_spec(families()["qwen3_omni"], {"checkpoint": qwen3_omni_tiny_dir}, _shape(16))
    assert decided == {} and spec.stages.code2wav.num_replicas == 1


def test_the_builder_deploys_the_sized_replicas(omni_tiny_dir, monkeypatch, caplog):
    from omni_serve.deployments.builder import build_app
    from omni_serve.graph import sizing

    monkeypatch.setattr(sizing.ClusterShape, "detect", classmethod(lambda cls: _shape(2)))
    caplog.set_level("INFO", logger=sizing.__name__)

    def code2wav_replicas(args):
        stages = build_app(families()["qwen2_5_omni"], {"checkpoint": omni_tiny_dir, **args})._bound_deployment
        return stages.init_kwargs["code2wav"]._bound_deployment.num_replicas

    assert code2wav_replicas({}) == 2
    assert "stages.code2wav.num_replicas=2" in caplog.text and "2 CPUs" in caplog.text
    assert code2wav_replicas({"stages.code2wav.num_replicas": 1}) == 1
    assert code2wav_replicas({"sizing": "off"}) == 1


def test_detect_reads_this_machine_without_ray(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # make test runs unit tests in a Ray-connected process
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    shape = ClusterShape.detect()
    assert shape.cpus >= 1 and "this machine" in shape.source


@pytest.mark.parametrize(("args", "cpus", "replicas"), [
    ({"stages.code2wav.num_cpus": 1}, 4, 2),  # 4 CPUs less the other stages' 1.5 hold two at 1 CPU each
    ({"stages.code2wav.num_cpus": 0}, 4, 4),  # reserving nothing: the threads alone decide
    ({"thinker_layout": "disaggregated"}, 2, 1),  # the disaggregated thinker reserves 0.25 more: one fits
    ({"stages.thinker.autoscaling_config": {"min_replicas": 2, "max_replicas": 4}}, 2.25, 1),  # its minimum counts
])
def test_the_replicas_fit_the_cpus_the_other_stages_leave(omni_tiny_dir, args, cpus, replicas):
    spec, _ = sized_spec(families()["qwen2_5_omni"], {"checkpoint": omni_tiny_dir, **args}, _shape(cpus))
    assert spec.stages.code2wav.num_replicas == replicas


@pytest.mark.parametrize("config", ["qwen2_5_omni.yaml", "qwen2_5_omni_disagg.yaml"])
def test_the_shipped_configs_sized_to_two_cpus_reserve_at_most_two(omni_tiny_dir, config):
    import os

    import yaml

    path = os.path.join(os.path.dirname(__file__), "..", "..", "omni_serve", "configs", config)
    with open(path) as f:
        args = {**yaml.safe_load(f)["applications"][0]["args"], "checkpoint": omni_tiny_dir}
    spec, _ = sized_spec(families()["qwen2_5_omni"], args, _shape(2))
    stages = [spec.stage_spec(name) for name in spec.deployed_stages()]
    assert spec.ingress.num_cpus + sum(s.num_cpus * s.num_replicas for s in stages) <= 2


def test_an_unjoined_cluster_is_not_sized(omni_tiny_dir, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ClusterShape.detect() is None
    spec, decided = sized_spec(families()["qwen2_5_omni"], {"checkpoint": omni_tiny_dir})
    assert decided == {} and spec.stages.code2wav.num_replicas == 1


def test_a_serve_config_leaves_the_sized_replicas_to_the_cluster(omni_tiny_dir):
    from omni_serve.graph.serve_config import build_serve_config

    def entry(values):
        config, _ = build_serve_config("qwen2_5_omni", {"checkpoint": omni_tiny_dir, **values})
        return {d["name"]: d for d in config["applications"][0]["deployments"]}

    assert "num_replicas" not in entry({})["code2wav"]  # the builder sizes it where it runs: on the cluster
    assert entry({})["talker"]["num_replicas"] == 1
    assert entry({"stages.code2wav.num_replicas": 3})["code2wav"]["num_replicas"] == 3
    assert entry({"sizing": "off"})["code2wav"]["num_replicas"] == 1


def test_dotted_and_nested_values_merge_at_every_depth():
    from omni_serve.graph.spec import apply_overrides

    merged = apply_overrides({"stages.code2wav.num_replicas": 3, "stages": {"code2wav": {"num_cpus": 1}},
                              "stages.code2wav.resources": {"node:10.0.0.1": 0.01}})
    assert merged == {"stages": {"code2wav": {"num_replicas": 3, "num_cpus": 1,
                                              "resources": {"node:10.0.0.1": 0.01}}}}
