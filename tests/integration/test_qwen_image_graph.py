"""The served Qwen-Image graph over real HTTP: oracle vs diffusers, batching, cache, OpenAI client, bad input."""

from __future__ import annotations

import base64
import io
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from tests.image_oracle import (
    Result, assert_matches, assert_swaps_fail, decode_pixels, pipeline_result, response_result,
)

pytestmark = pytest.mark.integration
MODEL = "qwen-image"


@pytest.fixture(scope="module")
def client(image_app):
    import httpx

    with httpx.Client(base_url=image_app, timeout=180) as c:
        yield c


@pytest.fixture(scope="module")
def pipe(qwen_image_tiny_dir):
    from diffusers import QwenImagePipeline

    p = QwenImagePipeline.from_pretrained(qwen_image_tiny_dir)
    p.set_progress_bar_config(disable=True)
    return p


def reference(pipe, prompt, seed, steps, size=(64, 64), negative=None, cfg=4.0, n=1) -> Result:
    """diffusers' latents and uint8 images for a request."""
    w, h = size
    return pipeline_result(pipe, seed, prompt=prompt, negative_prompt=negative, true_cfg_scale=cfg, width=w,
                           height=h, num_inference_steps=steps, num_images_per_prompt=n)


def pixels(item: dict) -> np.ndarray:
    return decode_pixels(item["b64_json"])


def generate(client, **body):
    return client.post("/v1/images/generations", json={"model": MODEL, **body})


CASES = [
    {"prompt": "a red cat under a blue sky", "seed": 1, "num_inference_steps": 4},
    {"prompt": "dog", "seed": 2, "num_inference_steps": 6, "negative_prompt": "blurry", "true_cfg_scale": 3.0},
    {"prompt": "a house by the sea", "seed": 3, "num_inference_steps": 3, "size": "96x64", "n": 2},
    {"prompt": "green tree", "seed": 4, "num_inference_steps": 8, "negative_prompt": " "},
]


def case_reference(pipe, case) -> Result:
    size = tuple(int(v) for v in case.get("size", "64x64").split("x"))
    return reference(pipe, case["prompt"], case["seed"], case["num_inference_steps"], size,
                     case.get("negative_prompt"), case.get("true_cfg_scale", 4.0), case.get("n", 1))


def swapped_references(pipe, cases: list[dict], i: int) -> dict[str, Result]:
    """The references of case ``i`` with the prompt, then the seed, of the next case: what a request whose
    prompt embeddings or noise were mixed up with a batch partner's would return."""
    other = cases[(i + 1) % len(cases)]
    return {key: case_reference(pipe, {**cases[i], key: other[key]}) for key in ("prompt", "seed")}


def test_concurrent_requests_match_diffusers(client, pipe):
    """Requests at different timesteps and step counts share the DiT's forwards, yet each image equals
    diffusers' QwenImagePipeline on the same checkpoint and seed (with and without true CFG): its final latents
    (``return_latents``) within float rounding, its pixels within a level. The same comparison fails for the
    reference of another request's prompt or seed (negative controls)."""
    before = client.get("/health?fresh=1").json()["stages"]["dit"]
    with ThreadPoolExecutor(len(CASES)) as pool:
        responses = list(pool.map(lambda c: generate(client, **c, return_latents=True), CASES))
    for i, (case, r) in enumerate(zip(CASES, responses)):
        assert r.status_code == 200, r.text
        body = r.json()
        got = response_result(body["data"])
        positive = assert_matches(got, case_reference(pipe, case), case["prompt"])
        assert_swaps_fail(got, swapped_references(pipe, CASES, i), positive, case["prompt"])
        m = body["metrics"]
        assert m["num_inference_steps"] == case["num_inference_steps"]
        assert m["true_cfg"] == ("negative_prompt" in case)
        assert m["cached_steps"] == [0] * case.get("n", 1)
    health = client.get("/health?fresh=1").json()
    assert all(stage["active"] == 0 for stage in health["stages"].values())
    steps, forwards = (health["stages"]["dit"][k] - before[k] for k in ("items", "calls"))
    print(f"{steps} denoising steps in {forwards} DiT forwards")
    assert steps == sum(c["num_inference_steps"] for c in CASES)
    assert forwards < steps, "no two requests shared a DiT forward: the oracle did not see batched requests"


def test_latents_come_only_when_asked(client):
    r = generate(client, prompt="a cat", num_inference_steps=1, seed=1, size="96x64", n=2, return_latents=True)
    assert r.status_code == 200, r.text
    assert [d["latents"]["shape"] for d in r.json()["data"]] == [[(96 // 16) * (64 // 16), 64]] * 2
    assert all("latents" not in d for d in generate(client, prompt="a cat", num_inference_steps=1).json()["data"])


def test_cache_dit_reports_cached_steps(client, pipe):
    body = {"prompt": "a red cat under a blue sky", "seed": 5, "num_inference_steps": 10}
    cached = generate(client, **body, cache={"mode": "dbcache", "residual_diff_threshold": 0.5,
                                              "max_warmup_steps": 1})
    assert cached.status_code == 200, cached.text
    m = cached.json()["metrics"]
    assert m["cache_mode"] == "dbcache"
    assert m["cached_steps"][0] > 0 and m["cached_steps"][0] + m["computed_steps"][0] == 10
    exact = reference(pipe, body["prompt"], 5, 10)
    img = pixels(cached.json()["data"][0]).astype(float)
    mse = np.mean((img - exact.pixels[0]) ** 2)
    assert mse > 0  # an approximation, not the exact image
    off = generate(client, **body, cache={"mode": "off"}, return_latents=True)
    assert_matches(response_result(off.json()["data"]), exact, "cache off")
    # warm-up beyond the last step: every step computed (not a MemoryError from a 1e16-entry warm-up list)
    warm = generate(client, **body, cache={"mode": "dbcache", "max_warmup_steps": 10**16})
    assert warm.status_code == 200, warm.text
    assert warm.json()["metrics"]["cached_steps"] == [0]


def test_openai_client_images_generate(image_app):
    from openai import OpenAI

    oa = OpenAI(base_url=image_app + "/v1", api_key="unused")
    result = oa.images.generate(model=MODEL, prompt="a small blue bird", size="64x64", n=1,
                                response_format="b64_json", extra_body={"seed": 3, "num_inference_steps": 2})
    assert len(result.data) == 1
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.format == "PNG" and image.size == (64, 64)


BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "size": "65x64"}, "size"),
    ({"prompt": "x", "size": "0x64"}, "size"),
    ({"prompt": "x", "size": "4096x4096"}, "size"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 99}, "n"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 100000}, "num_inference_steps"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "model": "dall-e-3"}, "model"),
    ({"prompt": "x", "cache": {"mode": "dbcache", "residual_diff_threshold": 5.0}}, "cache.residual_diff_threshold"),
    ({"prompt": "x", "cache": {"mode": "fastest"}}, "cache.mode"),
    ({"prompt": "x", "true_cfg_scale": -1}, "true_cfg_scale"),
    ({"prompt": "x", "true_cfg_scale": float("inf")}, "true_cfg_scale"),  # JSON's Infinity
    ({"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale"),  # JSON's NaN
    ({"prompt": "x", "true_cfg_scale": 1e6}, "true_cfg_scale"),
    ({"prompt": 5}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_then_a_good_request_succeeds(client, body, param):
    # json.dumps, not httpx's json=: it writes float("inf") and float("nan") as JSON's Infinity and NaN
    r = client.post("/v1/images/generations", content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    ok = generate(client, prompt="a cat", num_inference_steps=1)
    assert ok.status_code == 200, ok.text


def test_routes_a_graph_does_not_serve_are_404(client, http):
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = http.post("/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 404 and "images" in r.json()["error"]["message"]
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
