"""The operator's path on a real local Ray cluster (``ray start --head``, its own, not the session's):
``omni-serve build`` writes a Serve config, ``serve deploy`` deploys it, it serves; then a load wave
drives code2wav into a bottleneck and Serve scales that stage up on its engine load and back down when the
load stops, with every request answered."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import yaml

from tests.integration.local_cluster import BIN, DASHBOARD, HTTP_PORT, URL, cli, local_cluster, wait_running

pytestmark = [pytest.mark.integration, pytest.mark.slow]

APP = "omni_autoscale"
FAST_AUTOSCALING = {  # seconds, so the wave fits a test; production values are in docs/autoscaling.md
    "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 3, "downscale_delay_s": 10,
    "look_back_period_s": 4, "metrics_interval_s": 0.5}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_cpus=3) as dashboard:
        yield dashboard


@pytest.fixture(scope="module")
def deployed(cluster, omni_tiny_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("build") / "serve_config.yaml"
    auto = json.dumps(FAST_AUTOSCALING | {"policy": {
        "policy_function": "omni_serve.autoscaling:EngineLoadPolicy", "policy_kwargs": {"target_load": 0.6}}})
    ratio = json.dumps({"policy_function": "omni_serve.autoscaling:StageRatioPolicy", "policy_kwargs": {
        "target_load": 0.6, "ratios": [{"stage": "talker", "per": "thinker", "min": 1}]}})
    built = cli(f"{BIN}/omni-serve", "build", "qwen2_5_omni", f"checkpoint={omni_tiny_dir}",
                 "--name", APP, "--host", "127.0.0.1", "--port", str(HTTP_PORT), "-o", str(config),
                 "stages.talker.params.max_codec_tokens=48", "stages.code2wav.params.num_steps=24",
                 f"stages.code2wav.autoscaling_config={auto}", f"stages.thinker.autoscaling_config={auto}",
                 f"stages.talker.autoscaling_config={auto}", f"autoscaling_policy={ratio}")
    assert built.returncode == 0, built.stderr
    deploy = cli(f"{BIN}/serve", "deploy", str(config), "-a", DASHBOARD)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr
    wait_running(APP)
    return config


def test_build_writes_a_valid_serve_config_that_serve_deploy_serves(deployed):
    from ray.serve.schema import ServeDeploySchema

    from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec

    config = yaml.safe_load(deployed.read_text())
    ServeDeploySchema.model_validate(config)
    app = config["applications"][0]
    from omni_serve.graph.stage_settings import config_graph_spec

    OmniGraphSpec.model_validate(config_graph_spec(app))  # the whole spec, every default written out
    assert app["autoscaling_policy"]["policy_function"] == "omni_serve.autoscaling:StageRatioPolicy"
    r = httpx.post(f"{URL}/v1/chat/completions", timeout=120, json={
        "model": "qwen2.5-omni", "modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"},
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "min_tokens": 6})
    assert r.status_code == 200, r.text
    assert base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])[:4] == b"RIFF"
    status = cli(f"{BIN}/serve", "status", "-a", DASHBOARD)
    assert yaml.safe_load(status.stdout)["applications"][APP]["status"] == "RUNNING"


def test_the_bottleneck_stage_scales_up_under_load_and_back_down_after(deployed):
    from omni_serve.bench.autoscale import WaveConfig, run_wave

    # the load stops 5 s after code2wav runs its second replica (75 s at most)
    wave = run_wave(WaveConfig(url=URL, dashboard=DASHBOARD, app=APP, load_s=75, concurrency=6,
                               max_idle_s=150, poll_s=1.0, stop_at={"code2wav": 2}, hold_s=5))
    print("\n" + wave.table(["thinker", "talker", "code2wav"]))
    print(f"requests: {len(wave.outcomes)}, HTTP 200: {wave.outcomes.count(200)}")
    assert wave.outcomes and not wave.errors and all(s == 200 for s in wave.outcomes), wave.errors[:3]
    up = wave.first_t("code2wav", 2)
    assert up is not None, "code2wav never scaled up"
    down = wave.first_t("code2wav", 1, after=wave.load_end_t)
    assert down is not None and down > up, "code2wav did not scale back down after the load stopped"
