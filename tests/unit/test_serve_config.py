"""`omni-serve build`: the Serve config it writes (Ray's ServeDeploySchema, the whole graph spec as args,
the application-level policy), checkpoint paths, and clear errors."""

from __future__ import annotations

import os

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from omni_serve.autoscaling import STAGE_RATIO_POLICY
from omni_serve.cli import main
from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec
from omni_serve.families.qwen_image.spec import QwenImageGraphSpec
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
    spec = OmniGraphSpec.model_validate(app["args"])
    assert spec.checkpoint == os.path.abspath(omni_tiny_dir)  # made absolute: it exists here
    assert spec.stages.code2wav.autoscaling_config["max_replicas"] == 3
    assert spec.stages.code2wav.num_cpus == 0.25  # the stage's other defaults are kept
    # every field is written out, defaults included
    assert app["args"]["stages"]["thinker"]["engine"]["ar"] == OmniGraphSpec.model_validate(
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
