"""The served Qwen-Image-Edit graph over real HTTP (multipart ``POST /v1/images/edits``): the official ``openai``
client's ``images.edit``, the image equal to diffusers' pipeline, inpainting with a mask, bad input as 400s in
OpenAI's shape, and the routes this graph does not serve as 404s; and, with this graph as the one-rank reference,
the DiT on two ranks (rows, then sequence) gives every request's latents of one rank (``test_parallel_stages.py``
says how). Deployed next to the session's other graphs, reserving no CPUs, and deleted when the module ends.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import pytest
from PIL import Image

from tests.conftest import tiny_checkpoint
from tests.image_oracle import assert_matches, assert_swaps_fail, response_result
from tests.integration.test_parallel_stages import CACHE, SEQUENCE, TWO_RANKS, _deploy, check_two_ranks_equal_one
from tests.unit.test_qwen_image_edit import openai_mask, png, reference, reference_pipeline, solid_png

pytestmark = pytest.mark.integration
MODEL = "qwen-image-edit"
STAGES = ("text_encoder", "vae_encoder", "dit", "vae")
EDIT_CASES = [
    {"prompt": "make the sky red", "image": (80, 48), "size": "64x64", "num_inference_steps": 2, "seed": 1},
    {"prompt": "add a cat", "image": (48, 80), "size": "64x96", "num_inference_steps": 3, "seed": 2,
     "negative_prompt": "blurry", "true_cfg_scale": 3.0, "cache": CACHE},
    {"prompt": "winter, snow on the roofs and the trees", "image": (64, 64), "size": "64x64",
     "num_inference_steps": 4, "seed": 3, "n": 2},
    {"prompt": "night", "image": (96, 64), "size": "96x64", "num_inference_steps": 3, "seed": 4,
     "negative_prompt": " ", "cache": CACHE},
    {"prompt": "a boat on the lake", "image": (64, 96), "size": "64x96", "num_inference_steps": 2, "seed": 5,
     "negative_prompt": "people", "n": 2},
    {"prompt": "sepia", "image": (64, 64), "size": "64x64", "num_inference_steps": 5, "seed": 6, "cache": CACHE},
]


@pytest.fixture(scope="module")
def edit_dir() -> str:
    return tiny_checkpoint("qwen_image_edit")


@pytest.fixture(scope="module")
def edit_app(ray_serve, edit_dir):
    from ray import serve

    from omni_serve.families.qwen_image_edit import build_app

    serve.run(build_app({"checkpoint": edit_dir, "ingress.num_cpus": 0, "max_input_bytes": 200_000,
                         "max_input_pixels": 500_000,
                         **{f"stages.{s}.num_cpus": 0 for s in STAGES}}),
              name="qwen_image_edit", route_prefix="/edit")
    yield ray_serve + "/edit"
    serve.delete("qwen_image_edit")


@pytest.fixture(scope="module")
def client(edit_app):
    import httpx

    with httpx.Client(base_url=edit_app, timeout=300) as c:
        yield c


def edit(client, files: dict, **fields):
    return client.post("/v1/images/edits", files=files, data={"model": MODEL, **fields})


def test_openai_client_edits_equal_the_pipeline(edit_app, edit_dir):
    """``images.edit`` of the official client (one image, extensions in ``extra_body``), two at once: each
    response is diffusers' QwenImageEditPipeline on the same checkpoint and seed (its final latents, which
    ``return_latents`` adds, within float rounding, and its pixels within a level). The first edit's response
    fails the same comparison against the reference with the second's prompt or seed."""
    from openai import OpenAI

    oa = OpenAI(base_url=edit_app + "/v1", api_key="unused")
    cases = [{"prompt": "make the sky red", "image": png(80, 48, 1), "size": "64x64", "steps": 2, "seed": 1},
             {"prompt": "add a cat", "image": png(48, 80, 2), "size": "64x96", "steps": 3, "seed": 2,
              "negative_prompt": "blurry", "true_cfg_scale": 3.0}]

    def run(case):
        extra = {"seed": case["seed"], "num_inference_steps": case["steps"], "return_latents": True}
        extra.update({k: case[k] for k in ("negative_prompt", "true_cfg_scale") if k in case})
        return oa.images.edit(model=MODEL, image=("in.png", case["image"], "image/png"), prompt=case["prompt"],
                              size=case["size"], n=1, response_format="b64_json", extra_body=extra)

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    pipe = reference_pipeline(edit_dir)
    served = [response_result(result.data) for result in results]
    positives = [assert_matches(got, reference(pipe, case), case["prompt"]) for case, got in zip(cases, served)]
    swapped = {key: reference(pipe, {**cases[0], key: cases[1][key]}, pixels=False) for key in ("prompt", "seed")}
    assert_swaps_fail(served[0], swapped, positives[0], cases[0]["prompt"])


def test_a_list_of_one_image_cache_fields_and_a_mask(client):
    """The client's list form (``image[]``), cache settings as form fields, and an inpainting edit (a mask)."""
    r = edit(client, {"image[]": ("in.png", png(64, 64, 3), "image/png")}, prompt="winter", size="64x64",
             num_inference_steps="4", seed="3", **{"cache[mode]": "dbcache", "cache[residual_diff_threshold]": "0.5",
                                                   "cache[max_warmup_steps]": "1"})
    assert r.status_code == 200, r.text
    m = r.json()["metrics"]
    assert m["cache_mode"] == "dbcache" and m["cached_steps"][0] + m["computed_steps"][0] == 4
    mask = openai_mask(64, 64, (slice(0, 32), slice(None)))
    r = edit(client, {"image": ("in.png", png(64, 64, 4), "image/png"), "mask": ("m.png", mask, "image/png")},
             prompt="a bird", num_inference_steps="1", seed="4", strength="0.5")
    assert r.status_code == 200, r.text
    assert Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))).size == (1024, 1024)


BAD = [
    ({}, {"prompt": "x"}, "image", "image is required"),
    ({"image": ("x.png", b"not an image", "image/png")}, {"prompt": "x"}, "image", "not an image in an accepted format"),
    ({"image": ("x.png", solid_png(1000, 1000), "image/png")}, {"prompt": "x"}, "image", "too large (1000x1000"),
    ({"image": ("x.png", b"x" * 200_001, "image/png")}, {"prompt": "x"}, "image", "too large"),
    ({"image": ("x.png", png(16, 16, 0), "image/png"), "mask": ("m.png", openai_mask(8, 8, (slice(None),) * 2),
                                                                "image/png")}, {"prompt": "x"}, "mask",
     "does not match"),
    ({"image": ("x.png", png(16, 16, 0), "image/png")}, {"prompt": ""}, "prompt", None),
    ({"image": ("x.png", png(16, 16, 0), "image/png")}, {"prompt": "x", "size": "65x64"}, "size", None),
    ({"image": ("x.png", png(16, 16, 0), "image/png")}, {"prompt": "x", "model": "dall-e-2"}, "model", None),
    ({"image": ("x.png", png(16, 16, 0), "image/png")}, {"prompt": "x", "cache[mode]": "fastest"}, "cache.mode",
     None),
    ({"image": ("x.png", png(16, 16, 0), "image/png")},
     {"prompt": "x", "cache[mode]": "dbcache", "cache[residual_diff_threshold]": "5"}, "cache.residual_diff_threshold",
     None),
]


@pytest.mark.parametrize("files, fields, param, words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_edits_are_400s_in_openais_shape(client, files, fields, param, words):
    r = client.post("/v1/images/edits", files=files or {"unused": ("u", b"", "text/plain")},
                    data={"model": MODEL, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert words is None or words in err["message"], err["message"]


def test_a_json_body_is_a_400_and_other_routes_are_404(client):
    r = client.post("/v1/images/edits", json={"prompt": "x", "model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/images/generations", json={"prompt": "a cat"})
    assert r.status_code == 404 and "/v1/images/edits" not in r.json()["error"]["message"]  # names no route
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 404
    assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
    health = client.get("/health?fresh=1").json()
    assert set(health["stages"]) == set(STAGES) and all(s["active"] == 0 for s in health["stages"].values())


@pytest.mark.slow
def test_two_ranks_equal_one(ray_serve, edit_app, edit_dir):
    """Rows split over two ranks, then the sequence: six edits in flight and one alone, against this module's
    one-rank graph (its results asked once); another seed fails. One two-rank graph at a time beside it: more edit
    graphs (several GB each) beside the session's graphs overran the CI machine's 24 GiB, and Ray's memory monitor
    killed the Serve controller."""
    from ray import serve

    cpus = {f"stages.{s}.num_cpus": 0 for s in STAGES}
    for two, kind in (("edit_ranks", TWO_RANKS), ("edit_sequence", SEQUENCE)):
        _deploy("qwen_image_edit", edit_dir, two, {**cpus, **kind})
        try:
            check_two_ranks_equal_one(edit_app, ray_serve + f"/{two}", EDIT_CASES, (1,), MODEL)
        finally:
            serve.delete(two)
