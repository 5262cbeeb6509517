"""bfloat16 stages on a CPU without oneDNN's bfloat16 product: they serve on the plain library path, say so in
``/health``, and answer what the float32 graph answers within bfloat16's rounding.

The CPU is emulated per replica: the stage's ``env_vars`` cap oneDNN and ATen to AVX2 (``ONEDNN_MAX_CPU_ISA``,
``ATEN_CPU_CAPABILITY``), which makes an AVX-512 machine's replica answer as an AVX2-only machine does (the same
refusal from oneDNN; ``tests/unit/test_cpu_capability.py`` checks the capability against the CPU's flags). On an
AVX2-only machine the cap changes nothing. Graphs: Qwen2.5-Omni with ``stages.code2wav.params.dit_dtype=bfloat16``
(the benchmark configs' setting) and Qwen-Image with every stage in bfloat16; each answer is compared with the
session's float32 graph on the same request. Qwen-Image's latents are the tight quantity (a negative control, another
seed, shows the comparison can fail). The tiny Omni checkpoint speaks at ~4e-7 of full scale, below the 16-bit
samples the API returns, so its served check is the path and the answer's samples; the bfloat16 mel's closeness
to float32's on the fallback path is ``test_bfloat16_dit_blocks_stay_close_to_float32``, which
``tests/unit/test_cpu_capability.py`` runs under the same cap.
"""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import soundfile as sf

from tests.image_oracle import response_result
from tests.integration.conftest import FIXED_TOPOLOGY, IMAGE_APP_ARGS, ORACLE

pytestmark = pytest.mark.integration
CAPPED_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
OMNI_STAGES = ("encoder", "thinker", "talker", "code2wav")


def capped(stage: str) -> dict:
    return {f"stages.{stage}.env_vars.{k}": v for k, v in CAPPED_ENV.items()}


def assert_plain_bfloat16_path(base_url: str, stage: str) -> None:
    """The stage's replica runs its bfloat16 linear layers on the plain path, and says why."""
    stats = httpx.get(f"{base_url}/health?fresh=1", timeout=30).json()["stages"][stage]
    kernels = stats["kernels"]
    assert kernels["cpu"]["onednn_max_cpu_isa"] == "AVX2" and not kernels["cpu"]["packed"]["bfloat16"], kernels
    path = kernels["paths"]["linear.bfloat16"]
    assert path["path"].startswith("F.linear") and "ONEDNN_MAX_CPU_ISA=AVX2" in path["reason"], path


@pytest.fixture(scope="module")
def omni_bf16_app(ray_serve, omni_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen2_5_omni import build_app

    serve.run(build_app({
        "checkpoint": omni_tiny_dir, **FIXED_TOPOLOGY, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in OMNI_STAGES},
        "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
        "stages.code2wav.params.num_steps": ORACLE["steps"], "stages.code2wav.params.dit_dtype": "bfloat16",
        **capped("code2wav"),
    }), name="omni_bf16_avx2", route_prefix="/omni_bf16")
    yield ray_serve + "/omni_bf16"
    serve.delete("omni_bf16_avx2")


@pytest.fixture(scope="module")
def image_bf16_app(ray_serve, qwen_image_tiny_dir):
    from ray import serve

    from omni_serve.families.qwen_image import build_app

    stages = ("text_encoder", "dit", "vae")
    serve.run(build_app({
        "checkpoint": qwen_image_tiny_dir, "default_size": "64x64", "default_steps": 4, "ingress.num_cpus": 0,
        **IMAGE_APP_ARGS, **{f"stages.{s}.engine.dtype": "bfloat16" for s in stages},
        **{k: v for s in stages for k, v in capped(s).items()},
    }), name="qwen_image_bf16_avx2", route_prefix="/image_bf16")
    yield ray_serve + "/image_bf16"
    serve.delete("qwen_image_bf16_avx2")


def speak(base_url: str, text: str = "hello world cat dog") -> np.ndarray:
    """``/v1/audio/speech`` of ``text`` (the talker is greedy, so both graphs speak the same codes)."""
    r = httpx.post(f"{base_url}/v1/audio/speech", timeout=300, json={
        "model": "qwen2.5-omni", "voice": "Chelsie", "input": text, "response_format": "wav", "temperature": 0,
        "seed": ORACLE["seed"]})
    assert r.status_code == 200, r.text
    samples, sr = sf.read(io.BytesIO(r.content), dtype="int16")
    assert sr == 24000 and samples.size
    return samples


def test_omni_with_a_bfloat16_code2wav_dit_serves_on_the_plain_path(omni_app, omni_bf16_app):
    """The replica takes the plain path and answers: as many 16-bit samples as the float32 graph, within the oracle
    tests' 2 levels of them."""
    assert_plain_bfloat16_path(omni_bf16_app, "code2wav")
    want, got = speak(omni_app), speak(omni_bf16_app)
    assert got.shape == want.shape
    assert int(np.abs(got.astype(int) - want).max()) <= 2


def test_qwen_image_in_bfloat16_serves_on_the_plain_path(image_app, image_bf16_app):
    """Latents within 2% of the float32 graph's scale; another seed's latents are farther than that."""
    assert_plain_bfloat16_path(image_bf16_app, "dit")

    def image(base_url: str, seed: int):
        r = httpx.post(f"{base_url}/v1/images/generations", timeout=300, json={
            "model": "qwen-image", "prompt": "a red house by the river", "seed": seed, "return_latents": True})
        assert r.status_code == 200, r.text
        return response_result(r.json()["data"]).latents

    want, got = image(image_app, 3), image(image_bf16_app, 3)
    scale = float(want.abs().max())
    err = float((got - want).abs().max()) / scale
    assert err < 0.02, err
    other = float((image(image_app, 4) - got).abs().max()) / scale  # negative control: another seed
    print(f"\nbfloat16 (plain path) latents vs float32: {err:.2e} of the peak; another seed: {other:.2e}")
    assert other > 5 * max(err, 1e-3), (other, err)
