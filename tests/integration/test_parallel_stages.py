"""DiT stages whose replica spans two ranks, served over HTTP: with ``stages.dit.parallel.rows: 2`` each step's rows are
split between the replica and a rank worker in its placement group; with ``parallel.sequence: 2`` (Qwen-Image,
Qwen-Image-Edit) both compute every row, each a share of its image tokens. Every request's final latents equal the
one-rank graph's for the same request, alone and six in flight with different sizes, prompt lengths, image counts and
CFG, with cache-dit on and off (Qwen-Image, Qwen-Image-Edit; GLM-Image's DiT has no cache). The Qwen-Image-Edit case
is in ``test_qwen_image_edit_graph.py``, against that module's graph as the one-rank one. Another seed's latents fail
the same comparison (the negative control). A rank worker killed (its process, SIGKILL) while the replica is idle
fails the replica's health check, and Serve replaces it with one with new ranks."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.image_oracle import response_result
from tests.integration.conftest import IMAGE_APP_ARGS
from tests.integration.test_glm_image_graph import CASES as GLM_CASES  # sizes, steps, CFG, image counts differ

pytestmark = pytest.mark.integration

# Measured ~1e-7 (the same sums over other batch compositions); a mixed-up row is off by ~1e-1.
REL_TOL = 1e-4
TWO_RANKS = {"stages.dit.num_cpus": 0.01, "stages.dit.parallel.rows": 2, "stages.dit.parallel.rank_cpus": 0.01,
             "stages.dit.parallel.call_timeout_s": 60}
SEQUENCE = {**TWO_RANKS, "stages.dit.parallel.rows": 1, "stages.dit.parallel.sequence": 2}
CACHE = {"mode": "dbcache", "residual_diff_threshold": 0.5, "max_warmup_steps": 1}
CASES = [
    {"prompt": "a red cat under a blue sky at noon", "seed": 1, "num_inference_steps": 4},
    {"prompt": "dog", "seed": 2, "num_inference_steps": 6, "negative_prompt": "blurry", "true_cfg_scale": 3.0,
     "cache": CACHE},
    {"prompt": "a house by the sea", "seed": 3, "num_inference_steps": 3, "size": "96x64", "n": 2},
    {"prompt": "green tree", "seed": 4, "num_inference_steps": 8, "negative_prompt": " ", "cache": CACHE},
    {"prompt": "a lighthouse on a cliff, storm, waves, night, long exposure", "seed": 5, "num_inference_steps": 5,
     "size": "64x96", "negative_prompt": "people", "n": 2, "cache": CACHE},
    {"prompt": "moon", "seed": 6, "num_inference_steps": 7, "size": "96x64", "negative_prompt": "sun"},
]




def _deploy(family: str, checkpoint: str, name: str, extra: dict) -> None:
    import importlib

    from ray import serve

    build_app = importlib.import_module(f"omni_serve.families.{family}").build_app
    serve.run(build_app({"checkpoint": checkpoint, "ingress.num_cpus": 0, **extra}), name=name,
              route_prefix=f"/{name}")


@pytest.fixture(scope="module")
def ranked_image_app(ray_serve, qwen_image_tiny_dir):
    from ray import serve

    _deploy("qwen_image", qwen_image_tiny_dir, "image_ranks",
            {"default_size": "64x64", "default_steps": 4, **IMAGE_APP_ARGS, **TWO_RANKS})
    yield ray_serve + "/image_ranks"
    serve.delete("image_ranks")


def _generate(base: str, case: dict, model: str = "qwen-image") -> np.ndarray:
    import httpx

    if "image" in case:  # an edit: multipart, the image a random PNG of the case's size
        from tests.unit.test_qwen_image_edit import png

        fields = {k: v for k, v in case.items() if k not in ("image", "cache")}
        fields.update({f"cache[{k}]": v for k, v in case.get("cache", {}).items()})
        r = httpx.post(base + "/v1/images/edits", timeout=300,
                       files={"image": ("in.png", png(*case["image"], case["seed"]), "image/png")},
                       data={"model": model, "return_latents": "true", **{k: str(v) for k, v in fields.items()}})
    else:
        r = httpx.post(base + "/v1/images/generations", timeout=300,
                       json={"model": model, "return_latents": True, **case})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["metrics"]["cache_mode"] == ("dbcache" if case.get("cache") else "off")
    return response_result(body["data"]).latents.numpy(), body["metrics"]["cached_steps"]


def _in_flight(base: str, cases: list[dict], model: str = "qwen-image") -> list[np.ndarray]:
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda c: _generate(base, c, model), cases))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _dit(base: str) -> dict:
    import httpx

    return httpx.get(base + "/health?fresh=1", timeout=60).json()["stages"]["dit"]


# The one-rank graph's results, by (url, model, cases): a one-rank graph compared with two kinds of ranks is asked
# once (its latents depend on the requests alone).
_ONE_RANK: dict[tuple[str, str, str], list] = {}


def check_two_ranks_equal_one(one_rank: str, two_ranks: str, cases: list[dict], alone: tuple[int, ...],
                              model: str) -> None:
    """``cases`` all in flight on each graph, then the ``alone`` ones one at a time on the two-rank graph: every
    request's latents equal the one-rank graph's; another seed's do not; both ranks computed rows."""
    before = _dit(two_ranks)["parallel"]
    assert before["ranks"] == 2 and before["alive"]
    print(f"{model}: {before['kinds']}")
    key = (one_rank, model, json.dumps(cases, sort_keys=True))
    if key not in _ONE_RANK:
        _ONE_RANK[key] = _in_flight(one_rank, cases, model)
    one = _ONE_RANK[key]
    two = _in_flight(two_ranks, cases, model) + [_generate(two_ranks, cases[i], model) for i in alone]
    expected = one + [one[i] for i in alone]
    # cache-dit made the same decisions (cached steps) on both graphs, and it did cache steps
    assert [cached for _, cached in two] == [cached for _, cached in expected]
    if any("cache" in c for c in cases):
        assert sum(sum(cached) for (_, cached), c in zip(one, cases) if "cache" in c) > 0, "no step was cached"
    errors = [_rel(t, o) for (t, _), (o, _) in zip(two, expected)]
    print(f"{model}: two ranks vs one, relative error of the latents:", " ".join(f"{e:.1e}" for e in errors))
    assert max(errors) < REL_TOL, errors
    control = _rel(_generate(two_ranks, {**cases[0], "seed": 99}, model)[0], one[0][0])
    print(f"{model}: another seed: {control:.1e}")
    assert control > 1000 * REL_TOL
    after = _dit(two_ranks)["parallel"]
    if "rows_by_rank" not in after:  # sequence parallelism: every rank computes every row, a share of its tokens
        tokens = {k: after["image_tokens"][k] - before["image_tokens"][k] for k in ("all", "rank_0")}
        print(f"{model}: image tokens, all and the replica's share:", tokens)
        assert 0.25 * tokens["all"] < tokens["rank_0"] < 0.75 * tokens["all"], tokens
        return
    split = [a - b for a, b in zip(after["rows_by_rank"], before["rows_by_rank"])]
    print(f"{model}: rows computed by rank:", split)
    assert min(split) > 0.25 * sum(split), split  # both ranks did a fair share


def test_qwen_image_two_ranks_equal_one(ranked_image_app, image_app):
    check_two_ranks_equal_one(image_app, ranked_image_app, CASES, (1, 4), "qwen-image")  # CFG + cache alone


def test_qwen_image_sequence_parallel_equals_one_rank(ray_serve, image_app, qwen_image_tiny_dir):
    from ray import serve

    _deploy("qwen_image", qwen_image_tiny_dir, "image_sequence",
            {"default_size": "64x64", "default_steps": 4, **IMAGE_APP_ARGS, **SEQUENCE})
    try:
        check_two_ranks_equal_one(image_app, ray_serve + "/image_sequence", CASES, (1, 4), "qwen-image")
    finally:
        serve.delete("image_sequence")


def test_glm_image_two_ranks_equal_one(ray_serve, glm_app, glm_image_tiny_dir):
    from ray import serve

    from tests.integration.conftest import GLM_STAGES

    _deploy("glm_image", glm_image_tiny_dir, "glm_ranks", {"default_size": "64x64", "default_steps": 3,
                                                           **{f"stages.{s}.num_cpus": 0 for s in GLM_STAGES},
                                                           **TWO_RANKS})
    try:
        check_two_ranks_equal_one(glm_app, ray_serve + "/glm_ranks", GLM_CASES, (2,), "glm-image")
    finally:
        serve.delete("glm_ranks")


def test_a_rank_killed_while_idle_fails_the_health_check_and_the_replica_is_replaced(ranked_image_app):
    """No request meets the dead rank: the replica's health check probes its workers, and Serve replaces it (a
    request that meets a dead rank gets a 503: ``test_tensor_parallel_stage.py``)."""
    import httpx

    workers = _dit(ranked_image_app)["parallel"]["worker_pids"]
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)  # the same machine: the rank worker's process dies
    deadline = time.monotonic() + 180
    while True:
        try:
            after = _dit(ranked_image_app).get("parallel", {})
            if after.get("alive") and after.get("worker_pids", workers) != workers:
                break
        except Exception:  # noqa: BLE001 - /health answers 503 (no body with stages) while the stage has no replica
            pass
        assert time.monotonic() < deadline, "the replica with a dead rank was not replaced"
        time.sleep(1)
    r = httpx.post(ranked_image_app + "/v1/images/generations", timeout=120,
                   json={"model": "qwen-image", "prompt": "a cat", "negative_prompt": "dog", "seed": 1})
    assert r.status_code == 200, r.text
