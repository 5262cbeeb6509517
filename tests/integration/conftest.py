"""One local Ray instance for the whole integration session, serving the Omni graph at ``/`` and the
Qwen-Image graph at ``/image`` (each deployed on first use)."""

from __future__ import annotations

import os

import pytest

ORACLE = {"thinker_tokens": 12, "talker_tokens": 20, "steps": 3, "seed": 7}
# The code2wav settings of every graph held to transformers' token2wav: its steps, and float32 DiT blocks (the
# default, auto, runs them in bfloat16 on CPUs where that is faster, within ~7e-4 of float32 but not equal)
ORACLE_CODE2WAV = {"stages.code2wav.params.num_steps": ORACLE["steps"], "stages.code2wav.params.dit_dtype": "float32"}
TRANSCRIPT_TOKENS = 16  # the served graphs' transcription.max_tokens
TRANSCRIPTION = {"transcription.max_tokens": TRANSCRIPT_TOKENS, "transcription.max_file_bytes": 500_000}
# The tests' Qwen2.5-Omni graphs keep one replica per stage (``sizing: off``): what they check assumes the topology
# they deploy. test_speech_under_load serves the sized defaults, tests/unit/test_sizing.py checks the rule.
FIXED_TOPOLOGY = {"sizing": "off"}
METRICS_PORT = 8099  # the session's Ray metrics endpoint (Prometheus text at /metrics)


@pytest.fixture(scope="session")
def ray_serve():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    # address="local": a new instance even if another local cluster runs (test_autoscaling_deploy starts one)
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="omni_serve", log_to_driver=False,
             _metrics_export_port=METRICS_PORT)
    serve.start(http_options={"host": "127.0.0.1", "port": 8011})
    yield "http://127.0.0.1:8011"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def omni_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY,
        # every edge on the default connector (auto: shm on this one-node cluster) but one, so that the Ray object
        # store backend stays covered by the tests of the default graph (leaks, metrics, faults)
        "edges.thinker_talker.connector": "ray",
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        **ORACLE_CODE2WAV, **TRANSCRIPTION,
    }), name="omni", route_prefix="/")
    return ray_serve


# The disaggregated-thinker Omni graph at /disagg (same oracle settings), reserving no CPUs so it fits next
# to the aggregated one in the session's 2 logical CPUs.
DISAGG_STAGES = ("encoder", "thinker_prefill", "thinker_decode", "talker", "code2wav")


@pytest.fixture(scope="session")
def omni_disagg_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, "thinker_layout": "disaggregated", "ingress.num_cpus": 0,
        **{f"stages.{s}.num_cpus": 0 for s in DISAGG_STAGES},
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        **ORACLE_CODE2WAV,
    }), name="omni_disagg", route_prefix="/disagg")
    return ray_serve + "/disagg"


# Both graphs share the session's 2 logical CPUs: the image graph's stages reserve little.
IMAGE_APP_ARGS = {f"stages.{s}.num_cpus": 0 for s in ("text_encoder", "dit", "vae")}


@pytest.fixture(scope="session")
def image_app(ray_serve, qwen_image_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen_image import build_app

    serve.run(build_app({"checkpoint": qwen_image_tiny_dir, "default_size": "64x64", "default_steps": 4,
                         "ingress.num_cpus": 0, **IMAGE_APP_ARGS}),
              name="qwen_image", route_prefix="/image")
    return ray_serve + "/image"


@pytest.fixture(scope="session")
def http(omni_app):
    import httpx

    with httpx.Client(base_url=omni_app, timeout=120) as client:
        yield client


# The Qwen3-Omni graph at /qwen3 (oracle talker length), reserving no CPUs so it fits beside the others.
QWEN3_STAGES = ("encoder", "thinker", "talker", "code2wav")


@pytest.fixture(scope="session")
def qwen3_app(ray_serve, qwen3_omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen3_omni import build_app

    serve.run(build_app({
        "checkpoint": qwen3_omni_tiny_dir, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in QWEN3_STAGES},
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"], **TRANSCRIPTION,
    }), name="qwen3_omni", route_prefix="/qwen3")
    return ray_serve + "/qwen3"


# The GLM-Image graph at /glm (tiny checkpoint), reserving no CPUs so it fits beside the others.
GLM_STAGES = ("ar", "text_encoder", "dit", "vae")


@pytest.fixture(scope="session")
def glm_app(ray_serve, glm_image_tiny_dir):
    from ray import serve

    from omni_serve.families.glm_image import build_app

    serve.run(build_app({"checkpoint": glm_image_tiny_dir, "default_size": "64x64", "default_steps": 3,
                         "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in GLM_STAGES}}),
              name="glm_image", route_prefix="/glm")
    return ray_serve + "/glm"


# The Qwen3-ASR graph at /asr (tiny checkpoint, the oracle's windows and token limit), reserving no CPUs so it fits
# beside the others; one module uses it, and it is deleted after it (the session's memory holds every session-wide
# graph).
@pytest.fixture(scope="module")
def asr_app(ray_serve, qwen3_asr_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen3_asr import build_app
    from tests.asr_cases import ARGS

    serve.run(build_app({"checkpoint": qwen3_asr_tiny_dir, **ARGS, "ingress.num_cpus": 0,
                         **{f"stages.{s}.num_cpus": 0 for s in ("encoder", "llm")}}),
              name="qwen3_asr", route_prefix="/asr")
    yield ray_serve + "/asr"
    serve.delete("qwen3_asr")


# The combined voice app at /voice (omni_serve.deployments.combined): VibeVoice, Qwen3-ASR and Qwen2.5-Omni behind one
# ingress (speech and transcription each served by two of them), tiny checkpoints, the oracles' settings, reserving
# no CPUs; one module uses it, and it is deleted after it (its eight replicas would hold ~5 GiB through the session).
VOICE_SPEECH_TOKENS = 8  # VibeVoice's speech per request: max_speech_seconds = tokens / 7.5


@pytest.fixture(scope="module")
def voice_app(ray_serve, omni_tiny_dir, qwen3_asr_tiny_dir, vibevoice_tiny_dir, tmp_path_factory):
    from ray import serve

    from omni_serve.deployments.combined import build_app
    from tests.asr_cases import ARGS

    omni = {"checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, **{f"stages.{s}.num_cpus": 0 for s in QWEN3_STAGES},
            "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"], **ORACLE_CODE2WAV, **TRANSCRIPTION}
    asr = {"checkpoint": qwen3_asr_tiny_dir, **ARGS, **{f"stages.{s}.num_cpus": 0 for s in ("encoder", "llm")}}
    vibevoice = {"checkpoint": vibevoice_tiny_dir, "max_speech_seconds": VOICE_SPEECH_TOKENS / 7.5,
                 "stages.lm.num_cpus": 0, "stages.lm.engine.torch_threads": 1,
                 "voices.dir": str(tmp_path_factory.mktemp("voices"))}
    serve.run(build_app({"graphs": {"vibevoice": vibevoice, "qwen3_asr": asr, "qwen2_5_omni": omni},
                         "ingress.num_cpus": 0}), name="voice", route_prefix="/voice")
    yield ray_serve + "/voice"
    serve.delete("voice")
