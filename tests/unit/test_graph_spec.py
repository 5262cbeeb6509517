"""Graph spec: defaults, dotted overrides, the shipped Serve config file, and clear errors."""

from __future__ import annotations

import os

import pytest
import yaml
from pydantic import ValidationError

from omni_serve.autoscaling import ENGINE_LOAD_POLICY, STAGE_RATIO_POLICY
from omni_serve.families.qwen2_5_omni import FAMILY

build_spec = FAMILY.validate
from omni_serve.graph.spec import STAGE_ENV, apply_overrides

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "omni_serve", "configs", "qwen2_5_omni.yaml")
DISAGG_CONFIG = os.path.join(os.path.dirname(CONFIG), "qwen2_5_omni_disagg.yaml")


def test_dotted_overrides_nest():
    assert apply_overrides({"a.b.c": 1, "a.d": 2, "e": 3}) == {"a": {"b": {"c": 1}, "d": 2}, "e": 3}


def test_build_spec_applies_overrides_and_resolves_checkpoint(omni_tiny_dir):
    rel = os.path.relpath(omni_tiny_dir)
    spec = build_spec({"checkpoint": rel, "stages.thinker.num_replicas": 3,
                       "stages.talker.params.max_codec_tokens": 7, "edges.thinker_talker.chunk_size": 4})
    assert os.path.isabs(spec.checkpoint)
    assert spec.stages.thinker.num_replicas == 3
    assert spec.stages.talker.params.max_codec_tokens == 7
    assert spec.edges.thinker_talker.chunk_size == 4
    opts = spec.stages.thinker.deployment_options("thinker")
    assert opts["num_replicas"] == 3 and opts["ray_actor_options"]["num_cpus"] == spec.stages.thinker.num_cpus


def test_autoscaling_replaces_fixed_replicas(omni_tiny_dir):
    auto = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8}
    spec = build_spec({"checkpoint": omni_tiny_dir, "stages.talker.autoscaling_config": auto})
    opts = spec.stages.talker.deployment_options("talker")
    assert "num_replicas" not in opts
    # the stage scales on its engine's load unless the config names another policy
    assert opts["autoscaling_config"] == {**auto, "policy": {"policy_function": ENGINE_LOAD_POLICY}}
    own = {**auto, "policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}}
    spec = build_spec({"checkpoint": omni_tiny_dir, "stages.talker.autoscaling_config": own})
    assert spec.stages.talker.deployment_options("talker")["autoscaling_config"] == own


@pytest.mark.parametrize("bad, match", [
    ({"min_replicas": 3, "max_replicas": 2}, "max_replicas"),
    ({"max_replicas": 2, "policy": {"policy_function": ENGINE_LOAD_POLICY, "policy_kwargs": {"target": 1}}},
     "target"),
    ({"max_replicas": 2, "policy": {"policy_function": STAGE_RATIO_POLICY}}, "application-level"),
    ({"max_replicas": 2, "policy": {"policy_function": "omni_serve.autoscaling:Nope"}}, "Nope"),
])
def test_a_bad_autoscaling_config_fails_the_spec(omni_tiny_dir, bad, match):
    with pytest.raises(ValueError, match=match):
        build_spec({"checkpoint": omni_tiny_dir, "stages.talker.autoscaling_config": bad})


def test_application_autoscaling_policy_is_checked(omni_tiny_dir):
    ok = {"policy_function": STAGE_RATIO_POLICY,
          "policy_kwargs": {"ratios": [{"stage": "talker", "per": "thinker", "min": 0.5, "max": 2}]}}
    assert build_spec({"checkpoint": omni_tiny_dir, "autoscaling_policy": ok}).autoscaling_policy == ok
    bad = {"policy_function": STAGE_RATIO_POLICY,
           "policy_kwargs": {"ratios": [{"stage": "talker", "per": "thinker", "min": 2, "max": 1}]}}
    with pytest.raises(ValueError, match="below min"):
        build_spec({"checkpoint": omni_tiny_dir, "autoscaling_policy": bad})


@pytest.mark.parametrize("layout", ["aggregated", "disaggregated"])
def test_default_resources_fit_a_two_core_machine(omni_tiny_dir, layout):
    spec = build_spec({"checkpoint": omni_tiny_dir, "thinker_layout": layout})
    total = spec.ingress.num_cpus + sum(getattr(spec.stages, s).num_cpus for s in spec.deployed_stages())
    assert total <= 2


def test_thinker_layout_chooses_the_deployed_stages(omni_tiny_dir):
    agg = build_spec({"checkpoint": omni_tiny_dir})
    assert agg.deployed_stages() == ["encoder", "thinker", "talker", "code2wav"]
    assert agg.text_stage() == "thinker"
    dis = build_spec({"checkpoint": omni_tiny_dir, "thinker_layout": "disaggregated",
                      "stages.thinker_decode.params.default_max_tokens": 9,
                      "edges.thinker_prefill_thinker_decode.connector": "shm"})
    assert dis.deployed_stages() == ["encoder", "thinker_prefill", "thinker_decode", "talker", "code2wav"]
    assert dis.text_stage() == "thinker_decode" and dis.thinker_params().default_max_tokens == 9
    assert dis.edges.thinker_prefill_thinker_decode.connector == "shm"
    # every deployed stage has a runner and the edge field the runners resolve
    from omni_serve.families.qwen2_5_omni import GRAPH

    assert set(dis.deployed_stages()) | set(agg.deployed_stages()) <= {s.name for s in GRAPH.stages if s.runner}
    assert hasattr(dis.edges, GRAPH.stage("thinker_decode").reads[0])
    with pytest.raises(ValidationError, match="thinker_layout"):
        build_spec({"checkpoint": omni_tiny_dir, "thinker_layout": "split"})


@pytest.mark.parametrize("args, match", [
    ({"checkpoint": "/nonexistent/dir"}, "not a checkpoint directory"),
    ({"checkpoint": "x", "stages.thinker.bogus": 1}, "bogus"),
    ({"checkpoint": "x", "stages.thinker.num_replicas": 0}, "num_replicas"),
])
def test_bad_specs_fail_clearly(args, match):
    with pytest.raises((ValidationError, ValueError), match=match):
        build_spec(args)


def shipped_app(config_file: str, import_path: str) -> dict:
    """The one application of a shipped Serve config, after validating the file against Ray's schema."""
    from ray.serve.schema import ServeDeploySchema

    with open(config_file) as f:
        config = yaml.safe_load(f)
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    assert app["import_path"] == import_path
    return app


@pytest.mark.parametrize("config_file, layout", [(CONFIG, "aggregated"), (DISAGG_CONFIG, "disaggregated")])
def test_shipped_serve_config_validates(omni_tiny_dir, config_file, layout):
    app = shipped_app(config_file, "omni_serve.families.qwen2_5_omni:build_app")
    spec = build_spec({**app["args"], "checkpoint": omni_tiny_dir})
    assert spec.thinker_layout == layout
    assert spec.ingress.num_cpus + sum(getattr(spec.stages, s).num_cpus for s in spec.deployed_stages()) <= 2
    if config_file == CONFIG:  # "the explicit values ARE the defaults", code2wav's replicas left to sizing
        assert spec == build_spec({"checkpoint": omni_tiny_dir})
        assert "num_replicas" not in app["args"]["stages"]["code2wav"]


IMAGE_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "omni_serve", "configs", "qwen_image.yaml")


def test_shipped_qwen_image_config_validates_and_fits_two_cores(qwen_image_tiny_dir):
    from omni_serve.families.qwen_image import FAMILY as IMAGE

    app = shipped_app(IMAGE_CONFIG, "omni_serve.families.qwen_image:build_app")
    spec = IMAGE.validate({**app["args"], "checkpoint": qwen_image_tiny_dir})
    total = spec.ingress.num_cpus + sum(getattr(spec.stages, s).num_cpus for s in spec.stages.model_fields)
    assert total <= 2
    opts = spec.stages.dit.deployment_options("dit")
    assert opts["ray_actor_options"]["runtime_env"] == {"env_vars": STAGE_ENV}


@pytest.mark.parametrize("args, match", [
    ({"checkpoint": "/nonexistent/dir"}, "not a checkpoint directory"),
    ({"checkpoint": "x", "default_steps": 500}, "default_steps"),
    ({"checkpoint": "x", "default_size": "big"}, "default_size"),
    ({"checkpoint": "x", "stages.dit.params.cache.mode": "fastest"}, "mode"),
])
def test_bad_image_specs_fail_clearly(args, match):
    from omni_serve.families.qwen_image import FAMILY as IMAGE

    with pytest.raises((ValidationError, ValueError), match=match):
        IMAGE.validate(args)


def test_overriding_some_keys_of_a_stage_keeps_its_other_defaults(omni_tiny_dir):
    spec = build_spec({"checkpoint": omni_tiny_dir, "stages.code2wav.params.num_steps": 3,
                       "stages.encoder.env_vars.EXTRA": "1", "edges.talker_code2wav.connector": "shm"})
    assert spec.stages.code2wav.num_cpus == 0.25 and spec.stages.code2wav.params.num_steps == 3
    assert spec.stages.encoder.env_vars == {**STAGE_ENV, "EXTRA": "1"}
    edge = spec.edges.talker_code2wav
    assert (edge.connector, edge.chunk_size, edge.first_chunk_size) == ("shm", 12, 24)


def test_a_null_env_var_removes_that_default(omni_tiny_dir):
    spec = build_spec({"checkpoint": omni_tiny_dir, "stages.talker.env_vars.OMP_WAIT_POLICY": None,
                       "stages.talker.env_vars.EXTRA": "1"})
    assert spec.stages.talker.env_vars == {**{k: v for k, v in STAGE_ENV.items() if k != "OMP_WAIT_POLICY"},
                                           "EXTRA": "1"}
    assert spec.stages.thinker.env_vars == STAGE_ENV
    runtime_env = spec.stages.talker.deployment_options("talker")["ray_actor_options"]["runtime_env"]
    assert "OMP_WAIT_POLICY" not in runtime_env["env_vars"]


def test_env_var_numbers_and_booleans_become_text(omni_tiny_dir):
    """Overrides parse values as YAML: a number or boolean given for an environment variable is kept as its text."""
    spec = build_spec({"checkpoint": omni_tiny_dir, "stages.code2wav.env_vars.MALLOC_TRIM_THRESHOLD_": 1073741824,
                       "stages.code2wav.env_vars.SOME_FLAG": True, "stages.code2wav.env_vars.RATIO": 0.5})
    env = spec.stages.code2wav.env_vars
    assert (env["MALLOC_TRIM_THRESHOLD_"], env["SOME_FLAG"], env["RATIO"]) == ("1073741824", "true", "0.5")


def test_image_stage_overrides_keep_the_stage_defaults():
    from omni_serve.families.qwen_image.spec import QwenImageGraphSpec

    spec = QwenImageGraphSpec.model_validate(apply_overrides({"checkpoint": "/x", "stages.dit.num_cpus": 0}))
    assert spec.stages.dit.num_cpus == 0 and spec.stages.dit.engine.torch_threads == 2


GLM_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "omni_serve", "configs", "glm_image.yaml")


def test_shipped_glm_image_config_is_the_defaults_fits_two_cores_and_scales_on_engine_load(glm_image_tiny_dir):
    from omni_serve.families.glm_image.spec import GlmImageGraphSpec

    app = shipped_app(GLM_CONFIG, "omni_serve.families.glm_image:build_app")
    spec = GlmImageGraphSpec.model_validate({**app["args"], "checkpoint": glm_image_tiny_dir})
    assert spec == GlmImageGraphSpec(checkpoint=glm_image_tiny_dir)  # "the explicit values ARE the defaults"
    total = spec.ingress.num_cpus + sum(getattr(spec.stages, s).num_cpus for s in type(spec.stages).model_fields)
    assert total <= 2
    auto = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}
    for stage in ("ar", "dit"):
        scaled = GlmImageGraphSpec.model_validate({**app["args"], "checkpoint": glm_image_tiny_dir, "stages": {
            **app["args"]["stages"], stage: {**app["args"]["stages"][stage], "num_replicas": None,
                                             "autoscaling_config": auto}}})
        opts = getattr(scaled.stages, stage).deployment_options(stage)
        assert "num_replicas" not in opts
        assert opts["autoscaling_config"] == {**auto, "policy": {"policy_function": ENGINE_LOAD_POLICY}}


def test_parallel_settings_become_placement_bundles_and_bad_ones_fail(qwen_image_tiny_dir):
    from omni_serve.families.qwen_image import FAMILY as IMAGE

    spec = IMAGE.validate({"checkpoint": qwen_image_tiny_dir, "stages.dit.num_cpus": 1,
                           "stages.dit.resources": {"omni_dit": 1}, "stages.dit.parallel.rows": 3,
                           "stages.dit.parallel.rank_cpus": 0.5})
    options = spec.stage_spec("dit").deployment_options("dit")
    assert options["placement_group_bundles"] == [{"omni_dit": 1, "CPU": 1}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert "placement_group_bundles" not in spec.stage_spec("vae").deployment_options("vae")
    bad = [({"stages.vae.parallel.rows": 2}, "not supported by this stage"),
           ({"stages.dit.parallel.rows": 1, "stages.dit.parallel.tensor": 2}, "not supported by this stage"),
           ({"stages.dit.parallel.rank_cpus": 0}, "rank's bundle cannot be empty"),
           ({"stages.dit.num_cpus": 0}, "replica's placement-group bundle cannot be empty"),
           ({"stages.dit.parallel.rank_gpus": 1}, "all have GPUs or none")]
    for values, message in bad:
        with pytest.raises(ValidationError, match=message):
            IMAGE.validate({"checkpoint": qwen_image_tiny_dir, "stages.dit.parallel.rows": 2, **values})
    with pytest.raises(ValidationError, match="one parallel kind per stage"):
        FAMILY.validate({"checkpoint": "x", "stages.thinker.parallel.rows": 2, "stages.thinker.parallel.tensor": 2})


def test_sequence_parallelism_is_for_the_qwen_image_dits(qwen_image_tiny_dir):
    from omni_serve.families.glm_image import FAMILY as GLM
    from omni_serve.families.qwen_image import FAMILY as IMAGE

    spec = IMAGE.validate({"checkpoint": qwen_image_tiny_dir, "stages.dit.parallel.sequence": 2})
    p = spec.stage_spec("dit").parallel
    assert p.ranks == 2 and p.grouped and p.sharded is None and p.kinds() == {"sequence": 2}
    for family, values in [(IMAGE, {"stages.vae.parallel.sequence": 2}), (GLM, {"stages.dit.parallel.sequence": 2})]:
        with pytest.raises(ValidationError, match="not supported by this stage"):
            family.validate({"checkpoint": qwen_image_tiny_dir, **values})
    with pytest.raises(ValidationError, match="one parallel kind per stage"):
        IMAGE.validate({"checkpoint": qwen_image_tiny_dir, "stages.dit.parallel.sequence": 2,
                        "stages.dit.parallel.rows": 2})


def test_expert_parallelism_is_for_the_qwen3_omni_mixtures_of_experts(qwen3_omni_tiny_dir):
    from omni_serve.families.qwen3_omni import FAMILY as QWEN3

    spec = QWEN3.validate({"checkpoint": qwen3_omni_tiny_dir, "stages.thinker.parallel.expert": 2,
                           "stages.talker.parallel.expert": 2})
    for stage in ("thinker", "talker"):
        p = spec.stage_spec(stage).parallel
        assert p.ranks == 2 and p.sharded == "expert" and p.kinds() == {"expert": 2}
        assert len(spec.stage_spec(stage).deployment_options(stage)["placement_group_bundles"]) == 2
    for family, values in [(QWEN3, {"stages.code2wav.parallel.expert": 2}),
                           (QWEN3, {"stages.thinker.parallel.tensor": 2}),
                           (FAMILY, {"stages.thinker.parallel.expert": 2}),
                           (FAMILY, {"stages.talker.parallel.expert": 2})]:
        with pytest.raises(ValidationError, match="not supported by this stage"):
            family.validate({"checkpoint": qwen3_omni_tiny_dir, **values})
