"""The served GLM-Image graph over real HTTP (Ray Serve, the default ``auto`` connector: shared memory on this one
node): images equal ``GlmImagePipeline`` with 6 requests in flight (negative controls included), the official
client, bad input, and cancellation freeing the AR's KV blocks, the DiT's rows and every payload."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from omni_serve import settings
from tests.image_oracle import assert_matches, assert_swaps_fail, pipeline_result, response_result
from tests.integration.http_waits import busy_stages, held_payloads, wait_until

pytestmark = pytest.mark.integration
MODEL = "glm-image"
CASES = [  # one per request, all in flight together: sizes, steps, CFG and image counts differ
    {"prompt": "a red house by the river", "seed": 1, "num_inference_steps": 3, "guidance_scale": 1.5,
     "size": "96x96"},  # the negative controls' case: 9 visual tokens of the target grid (64x64: 4)
    {"prompt": "two cats on a blue sofa", "seed": 2, "num_inference_steps": 2, "size": "96x64"},
    {"prompt": "a city road in the rain", "seed": 3, "num_inference_steps": 4, "size": "64x96",
     "guidance_scale": 2.0, "n": 2},
    {"prompt": "green mountain", "seed": 4, "num_inference_steps": 2, "guidance_scale": 1.0},
    {"prompt": 'a sign that says "open"', "seed": 5, "num_inference_steps": 3, "guidance_scale": 3.0},
    {"prompt": "a bird on a tree", "seed": 6, "num_inference_steps": 3},
]


@pytest.fixture(scope="module")
def client(glm_app):
    with httpx.Client(base_url=glm_app, timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def pipe(glm_image_tiny_dir):
    from diffusers import GlmImagePipeline

    p = GlmImagePipeline.from_pretrained(glm_image_tiny_dir)
    p.set_progress_bar_config(disable=True)
    return p


def reference(pipe, case: dict, pixels: bool = True, **change):
    case = {**case, **change}
    width, height = map(int, case.get("size", "64x64").split("x"))
    return pipeline_result(pipe, case["seed"], pixels=pixels, prompt=case["prompt"], width=width, height=height,
                           num_inference_steps=case["num_inference_steps"],
                           guidance_scale=case.get("guidance_scale", 1.5), num_images_per_prompt=case.get("n", 1))


def generate(client, **body):
    return client.post("/v1/images/generations", json={"model": MODEL, "return_latents": True, **body})


def test_six_in_flight_equal_the_pipeline(client, pipe):
    with ThreadPoolExecutor(len(CASES)) as pool:
        responses = list(pool.map(lambda c: generate(client, **c), CASES))
    for case, r in zip(CASES, responses):
        assert r.status_code == 200, r.text
        body = r.json()
        got = response_result(body["data"])
        distance = assert_matches(got, reference(pipe, case), case["prompt"])
        assert body["metrics"]["true_cfg"] == (case.get("guidance_scale", 1.5) > 1)
        if case is CASES[0]:
            swapped = {"prompt": reference(pipe, case, pixels=False, prompt=CASES[1]["prompt"]),
                       "seed": reference(pipe, case, pixels=False, seed=case["seed"] + 1)}
            assert_swaps_fail(got, swapped, distance, case["prompt"])


def test_openai_client_images_generate(glm_app):
    import base64
    import io

    from openai import OpenAI
    from PIL import Image

    client = OpenAI(base_url=f"{glm_app}/v1", api_key="unused")
    out = client.images.generate(model=MODEL, prompt="a cat", size="64x64", extra_body={"seed": 3})
    image = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
    assert image.size == (64, 64)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a cat", "size": "48x64"}, "size"),
    ({"prompt": "a cat", "negative_prompt": "dogs"}, "negative_prompt"),
    ({"prompt": "a cat", "cache": {"mode": "dbcache"}}, "cache.mode"),
    ({"prompt": "a cat", "num_inference_steps": 1000}, "num_inference_steps"),
    ({"prompt": "a cat", "n": 99}, "n"),
    ({"prompt": " "}, None),
])
def test_bad_input_is_a_400(client, body, param):
    r = client.post("/v1/images/generations", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def _stage_stats() -> dict[str, dict]:
    from ray import serve

    return {s: serve.get_deployment_handle(s, app_name="glm_image").ready.remote().result()
            for s in ("ar", "text_encoder", "dit", "vae")}


def test_cancelling_mid_request_frees_kv_blocks_rows_and_payloads(glm_app, client):
    """A client that leaves while the AR writes the visual tokens, and one that leaves while the DiT denoises: every
    stage drops the request, the AR's KV blocks and every payload of the request are freed."""
    import asyncio

    assert generate(client, prompt="warm-up", seed=0).status_code == 200
    idle_payloads = held_payloads()

    def working(stage: str, stats: dict) -> bool:
        # the AR works once it has admitted the request (its blocks allocated): a request it has taken but not yet
        # scheduled is "active" a moment before that
        return stats["kv_blocks_used"] > 0 if stage == "ar" else bool(stats["active"])

    async def leave_while(stage: str, body: dict) -> dict:
        async with httpx.AsyncClient(timeout=300) as c:
            task = asyncio.create_task(c.post(f"{glm_app}/v1/images/generations",
                                              json={"model": MODEL, "prompt": "leave early", "seed": 9, **body}))
            for _ in range(1200):
                busy = await asyncio.to_thread(_stage_stats)
                if working(stage, busy[stage]) or task.done():
                    break
                await asyncio.sleep(0.05)
            assert not task.done(), f"the request ended before {stage} got it"
            task.cancel()
            return busy

    # 2048x2048: 4352 visual tokens, seconds of AR decoding; then 100 DiT steps of a 512x512 image
    for stage, body in (("ar", {"size": "2048x2048", "num_inference_steps": 1}),
                        ("dit", {"size": "512x512", "num_inference_steps": 100, "guidance_scale": 2.0})):
        busy = asyncio.run(leave_while(stage, body))
        assert working(stage, busy[stage]), busy[stage]
        assert busy_stages(glm_app) == {}
        stats = _stage_stats()
        assert stats["ar"]["kv_blocks_free"] == stats["ar"]["kv_blocks_total"], stats["ar"]
        assert all(s["active"] == 0 for s in stats.values()), stats
        # The ingress frees the request's payloads once its calls end; a stage that the cancellation reaches late
        # (a loaded replica) may still write one after that, which nobody reads: its producer's TTL sweep frees it
        # (OMNI_SERVE_DATA_TTL_S, then one sweep period of at most 5 s). Waiting for that sweep, not a guess at
        # how loaded the machine is, is the bound; freeing late writes at once is the data plane's own clean-up.
        wait_until(lambda: held_payloads() <= idle_payloads, settings.DATA_TTL_S + 5 + 15,
                   "the request's payloads are freed (at the latest by the producers' TTL sweep)")
    assert generate(client, prompt="after", seed=1).status_code == 200
