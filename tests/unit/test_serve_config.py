"""`omni-serve build`: the Serve config it writes (Ray's ServeDeploySchema, the graph-level spec as args and each
stage's settings in its own deployment entry, the application-level policy), checkpoint paths, and clear errors;
a changed stage setting changes only what must roll."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from omni_serve.autoscaling import STAGE_RATIO_POLICY
from omni_serve.cli import main
from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec
from omni_serve.families.qwen_image.spec import QwenImageGraphSpec
from omni_serve.graph.stage_settings import (STAGE_SPEC_ENV, STAGE_VIEWS_ENV, config_graph_spec, in_args,
                                                    own_stage, stage_views)
from omni_serve.graph.serve_config import build_serve_config

RATIO = {"policy_function": STAGE_RATIO_POLICY, "policy_kwargs": {
    "ratios": [{"stage": "talker", "per": "thinker", "min": 0.5, "max": 2}]}}


def test_build_writes_a_serve_deploy_config_with_the_whole_spec(omni_tiny_dir, tmp_path, capsys):
    out = tmp_path / "serve.yaml"
    rel = os.path.relpath(omni_tiny_dir)
    code = main(["build", "qwen2_5_omni", f"checkpoint={rel}", "--port", "8100", "-o", str(out),
                 "stages.code2wav.autoscaling_config={min_replicas: 1, max_replicas: 3}",  # after an option
                 f"autoscaling_policy={RATIO}"])
    assert code == 0, capsys.readouterr().err
    text = out.read_text()
    assert text.startswith("# Ray Serve config for the qwen2_5_omni graph")
    config = yaml.safe_load(text)
    ServeDeploySchema.model_validate(config)
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8100}
    (app,) = config["applications"]
    assert app["import_path"] == "omni_serve.families.qwen2_5_omni:build_app"
    assert app["autoscaling_policy"] == RATIO
    # each stage's settings live in its deployment entry; args keep only its engine backend (the graph's shape)
    assert app["args"]["stages"]["talker"] == {"engine": {"backend": "native"}}
    spec = OmniGraphSpec.model_validate(config_graph_spec(app))
    assert spec.checkpoint == os.path.abspath(omni_tiny_dir)  # made absolute: it exists here
    assert spec.stages.code2wav.autoscaling_config["max_replicas"] == 3
    assert spec.stages.code2wav.num_cpus == 0.25  # the stage's other defaults are kept
    # every field is written out, defaults included
    assert config_graph_spec(app)["stages"]["thinker"]["engine"]["ar"] == OmniGraphSpec.model_validate(
        {"checkpoint": "/x"}).stages.thinker.engine.ar.model_dump(mode="json")


def test_a_checkpoint_that_lives_on_the_cluster_must_be_absolute(tmp_path):
    config, notes = build_serve_config("qwen_image", {"checkpoint": "/models/qwen-image"})
    assert config["applications"][0]["args"]["checkpoint"] == "/models/qwen-image"
    assert notes and "must exist on the cluster" in notes[0]
    QwenImageGraphSpec.model_validate(config["applications"][0]["args"])
    with pytest.raises(ValueError, match="absolute path the cluster sees"):
        build_serve_config("qwen_image", {"checkpoint": "models/qwen-image"})


@pytest.mark.parametrize("override, message", [
    ("stages.thinker.num_cpu=1", "num_cpu"),
    ("stages.talker.autoscaling_config={max_replicas: 0}", "max_replicas"),
    ("autoscaling_policy={policy_function: 'omni_serve.autoscaling:StageRatioPolicy', "
     "policy_kwargs: {ratio: []}}", "ratio"),
])
def test_bad_values_exit_2_naming_the_field(override, message, capsys):
    assert main(["build", "qwen2_5_omni", "checkpoint=/models/omni", override]) == 2
    err = capsys.readouterr().err
    assert "invalid qwen2_5_omni graph values" in err and message in err


def test_build_to_stdout_and_unknown_options_fail(capsys):
    assert main(["build", "qwen_image", "checkpoint=/models/qi", "--name", "img", "--route-prefix", "/img"]) == 0
    config = yaml.safe_load(capsys.readouterr().out)
    assert config["applications"][0]["name"] == "img" and config["applications"][0]["route_prefix"] == "/img"
    with pytest.raises(SystemExit):
        main(["build", "qwen_image", "checkpoint=/models/qi", "--bogus"])


def _entries(values: dict) -> tuple[dict, dict]:
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    config, _ = build_serve_config("qwen2_5_omni", {"checkpoint": "/models/omni", **values})
    (app,) = config["applications"]
    return get_app_code_version(ServeApplicationSchema.model_validate(app)), {
        e["name"]: e for e in app["deployments"]}


def test_a_changed_stage_setting_changes_only_what_must_roll():
    version, before = _entries({})
    assert set(before) == {"encoder", "thinker", "talker", "code2wav", "ingress"}
    # CPUs: that stage's actor options (Serve rolls it); Serve's code version, the same for every deployment, stays
    v2, cpus = _entries({"stages.talker.num_cpus": 0.75})
    assert v2 == version and [n for n in before if before[n] != cpus[n]] == ["talker"]
    assert cpus["talker"]["ray_actor_options"]["num_cpus"] == 0.75
    # replicas, queue, shutdown budget: deployment options Serve applies in place, nothing else differs
    v3, scaled = _entries({"stages.code2wav.num_replicas": 3, "stages.code2wav.graceful_shutdown_timeout_s": 90})
    assert v3 == version and [n for n in before if before[n] != scaled[n]] == ["code2wav"]
    assert scaled["code2wav"]["ray_actor_options"] == before["code2wav"]["ray_actor_options"]
    assert scaled["code2wav"]["num_replicas"] == 3 and scaled["code2wav"]["graceful_shutdown_timeout_s"] == 90
    # params: the stage and the ingress (the frontend reads them), never the other stages
    v4, params = _entries({"stages.thinker.params.default_max_tokens": 99})
    assert v4 == version and [n for n in before if before[n] != params[n]] == ["thinker", "ingress"]
    # an engine setting only replicas read: that stage alone
    v7, threads = _entries({"stages.talker.engine.torch_threads": 2})
    assert v7 == version and [n for n in before if before[n] != threads[n]] == ["talker"]
    # autoscaling: its bounds in place; adding a policy changes every deployment's version (Serve hashes it)
    auto = {"min_replicas": 1, "max_replicas": 2}
    v8, scaled_auto = _entries({"stages.code2wav.autoscaling_config": auto})
    assert v8 != version
    v9, wider = _entries({"stages.code2wav.autoscaling_config": {**auto, "max_replicas": 4}})
    assert v9 == v8 and [n for n in scaled_auto if scaled_auto[n] != wider[n]] == ["code2wav"]
    assert wider["code2wav"]["ray_actor_options"] == scaled_auto["code2wav"]["ray_actor_options"]
    # to zero replicas: the ingress must know (such a stage is never "missing")
    _, to_zero = _entries({"stages.code2wav.autoscaling_config": {**auto, "min_replicas": 0}})
    assert [n for n in scaled_auto if scaled_auto[n] != to_zero[n]] == ["code2wav", "ingress"]
    # a graph-level setting is in args: everything rolls; so does a backend (the graph's shape may follow it)
    v5, _ = _entries({"ingress.request_timeout_s": 120})
    assert v5 != version
    v6, vllm = _entries({"stages.thinker.engine.backend": "vllm", "stages.thinker.engine.vllm.python": "/opt/v/py"})
    assert v6 != version and "encoder" not in vllm  # the vLLM thinker runs the media towers itself
    assert vllm["thinker"]["ray_actor_options"]["runtime_env"]["py_executable"] == "/opt/v/py"


def test_a_vllm_stage_on_the_clusters_interpreter_keeps_its_settings_in_args(monkeypatch):
    """Its interpreter (OMNI_SERVE_VLLM_PYTHON) is the cluster's, which only the builder there can read: an entry
    written here would carry this machine's, or none."""
    monkeypatch.setenv("OMNI_SERVE_VLLM_PYTHON", "/here/.venv-vllm/bin/python")
    config, _ = build_serve_config("qwen2_5_omni", {"checkpoint": "/models/omni", "stages.thinker.engine.backend": "vllm",
                                                    "stages.thinker.num_cpus": 3})
    (app,) = config["applications"]
    assert "thinker" not in {e["name"] for e in app["deployments"]}
    assert app["args"]["stages"]["thinker"]["num_cpus"] == 3
    assert "/here" not in json.dumps(config)


def test_replicas_read_their_settings_from_their_entries(monkeypatch):
    config, _ = build_serve_config("qwen2_5_omni", {"checkpoint": "/models/omni",
                                                    "stages.talker.params.max_codec_tokens": 7,
                                                    "stages.code2wav.autoscaling_config": {"min_replicas": 0,
                                                                                           "max_replicas": 2}})
    (app,) = config["applications"]
    entries = {e["name"]: e for e in app["deployments"]}
    bound = OmniGraphSpec.model_validate(app["args"]).model_dump(mode="json")  # what the builder binds: defaults
    env = lambda name, var: entries[name]["ray_actor_options"]["runtime_env"]["env_vars"][var]  # noqa: E731
    monkeypatch.setenv(STAGE_SPEC_ENV, env("talker", STAGE_SPEC_ENV))
    talker = OmniGraphSpec.model_validate(own_stage(bound, "talker"))
    assert talker.stages.talker.params.max_codec_tokens == 7
    monkeypatch.delenv(STAGE_SPEC_ENV)
    monkeypatch.setenv(STAGE_VIEWS_ENV, env("ingress", STAGE_VIEWS_ENV))
    ingress = OmniGraphSpec.model_validate(stage_views(bound))
    assert ingress.stages.talker.params.max_codec_tokens == 7
    assert ingress.stages.code2wav.autoscaling_config["min_replicas"] == 0  # never counted missing
    assert ingress.stages.thinker.autoscaling_config is None
    monkeypatch.delenv(STAGE_VIEWS_ENV)
    assert own_stage(bound, "talker") == stage_views(bound) == bound  # serve run / Python API: the bound spec


@pytest.mark.parametrize("values", [{}, {"stages.thinker.engine.backend": "vllm"}, {"thinker_layout": "disaggregated"}])
def test_the_builder_deploys_exactly_the_stages_the_entries_name(values):
    """The builder sees only ``args``: they must give the same graph shape as the entries'."""
    from omni_serve.graph.registry import family

    config, _ = build_serve_config("qwen2_5_omni", {"checkpoint": "/models/omni", **values})
    (app,) = config["applications"]
    fam = family("qwen2_5_omni")
    spec = fam.parse(app["args"])
    deployed = {s.name for s in fam.graph.deployed(spec.layout()) if not in_args(spec.stage_spec(s.name))}
    assert deployed | {"ingress"} == {e["name"] for e in app["deployments"]}
