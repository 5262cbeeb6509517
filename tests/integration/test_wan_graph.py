"""The served Wan text-to-video graph behind OpenAI's Videos API, over real HTTP with Ray, with two ingress replicas
sharing their jobs in a PostgreSQL database (a throwaway server the session starts) and a results directory: the
official ``openai`` client's ``videos.create_and_poll`` and ``download_content`` give a playable MP4 (PyAV decodes
the expected frames and size) while the job's progress only rises; a job alone and jobs in flight together (sizes,
frame counts, steps, seeds) give the final latents of diffusers' ``WanPipeline`` within float rounding and its
frames within a level (the ``npz`` output format), and the same comparison fails for a swapped prompt or seed; both
ingress replicas run jobs (each at most two at once) and answer for every job; the list pages; a deleted running
job frees its stages; bad requests are 400s and unknown ids 404s in OpenAI's shape."""

from __future__ import annotations

import io
import time

import httpx
import numpy as np
import pytest

from tests.image_oracle import Result, assert_matches, assert_swaps_fail
from tests.integration.http_waits import busy_stages
from tests.unit.test_wan_models import reference

pytestmark = pytest.mark.integration
MODEL = "wan2.1-t2v"
STAGES = ("text_encoder", "dit", "vae")


DATABASE: list[str] = []  # the job database's URL, for the tests that read it


@pytest.fixture(scope="module")
def wan_app(ray_serve, wan_tiny_dir, tmp_path_factory, postgres):
    from ray import serve

    from omni_serve.families.wan import build_app

    DATABASE.append(postgres.create_database())
    serve.run(build_app({
        "checkpoint": wan_tiny_dir, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in STAGES},
        "ingress.num_replicas": 2, "default_size": "32x16", "default_seconds": 1, "default_fps": 4,
        "default_steps": 3, "max_steps": 40, "max_frames": 17, "max_side": 64, "max_pixels": 64 * 64,
        "max_running_jobs": 2, "jobs.url": DATABASE[0], "jobs.results_dir": str(tmp_path_factory.mktemp("results")),
        "jobs.lease_s": 10.0}), name="wan", route_prefix="/wan")
    yield ray_serve + "/wan"
    serve.delete("wan")


def _workers(video_ids: list[str]) -> list[str]:
    """The ingress replicas that ran the jobs (a job's ``worker`` is its replica's id and a claim count)."""
    import sqlalchemy as sa

    engine = sa.create_engine(DATABASE[0].replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as db:
            rows = db.execute(sa.text("SELECT worker FROM jobs WHERE id = ANY(:ids)"), {"ids": video_ids}).scalars()
            return [w.rsplit("-", 1)[0] for w in rows]
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def wan_pipe(wan_tiny_dir):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(wan_tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _create(base: str, **fields) -> dict:
    r = httpx.post(base + "/v1/videos", data={"model": MODEL, **{k: str(v) for k, v in fields.items()}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(base: str, video_id: str, timeout_s: float = 300) -> tuple[dict, list[int]]:
    """The job once it ended, and the progress seen on the way."""
    seen, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/videos/{video_id}", timeout=30).json()
        seen.append(job["progress"])
        if job["status"] in ("completed", "failed"):
            return job, seen
        time.sleep(0.05)
    raise AssertionError(f"job {video_id} did not end in {timeout_s} s: {job}")


def test_the_official_client_creates_polls_and_downloads_a_playable_mp4(wan_app):
    import av
    from openai import OpenAI

    oa = OpenAI(base_url=wan_app + "/v1", api_key="unused")
    first = _create(wan_app, prompt="a red cat", seconds=1, size="32x16", num_inference_steps=12, seed=1)
    assert (first["object"], first["status"], first["progress"], first["seconds"]) == ("video", "queued", 0, "1")
    job, seen = _wait(wan_app, first["id"])
    assert job["status"] == "completed" and job["progress"] == 100 and job["completed_at"] >= job["created_at"]
    assert seen == sorted(seen) and len(set(seen)) > 2, seen  # it rose, step by step
    video = oa.videos.create_and_poll(model=MODEL, prompt="a green tree", seconds="1", size="32x16",
                                      poll_interval_ms=100)
    assert video.status == "completed" and video.model == MODEL
    data = oa.videos.download_content(video.id).read()
    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert container.streams.video[0].codec_context.name == "h264"
    assert len(frames) == 5 and frames[0].shape == (16, 32, 3)  # 1 s at 4 fps: 4k + 1 frames
    thumb = oa.videos.download_content(video.id, variant="thumbnail").read()
    assert thumb[:8] == b"\x89PNG\r\n\x1a\n"


CASES = [
    {"prompt": "a red cat", "size": (32, 16), "num_frames": 5, "steps": 3, "guidance_scale": 5.0, "seed": 1},
    {"prompt": "dog", "size": (32, 16), "num_frames": 5, "steps": 2, "guidance_scale": 1.0, "seed": 2},
    {"prompt": "a house by the sea at night", "size": (16, 32), "num_frames": 9, "steps": 4, "guidance_scale": 3.0,
     "negative_prompt": "blurry", "seed": 3},
    {"prompt": "green tree", "size": (32, 16), "num_frames": 5, "steps": 4, "guidance_scale": 4.0,
     "negative_prompt": "people", "seed": 4},
]


def _served(base: str, case: dict) -> dict:
    fields = {"prompt": case["prompt"], "size": "{}x{}".format(*case["size"]), "num_frames": case["num_frames"],
              "num_inference_steps": case["steps"], "guidance_scale": case["guidance_scale"], "seed": case["seed"],
              "output_format": "npz"}
    if "negative_prompt" in case:
        fields["negative_prompt"] = case["negative_prompt"]
    return _create(base, **fields)


def _result(base: str, video_id: str) -> Result:
    r = httpx.get(f"{base}/v1/videos/{video_id}/content", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream", r.text[:200]
    archive = np.load(io.BytesIO(r.content))
    return Result(archive["latents"][None], archive["frames"][None])


def test_one_job_alone_then_four_in_flight_equal_the_pipeline_and_a_swap_fails(wan_app, wan_pipe):
    import torch

    alone = _served(wan_app, CASES[0])
    assert _wait(wan_app, alone["id"])[0]["status"] == "completed"
    got = _result(wan_app, alone["id"])
    assert_matches(Result(torch.from_numpy(got.latents), got.pixels), reference(wan_pipe, CASES[0]), "alone")
    jobs = [_served(wan_app, case) for case in CASES]
    for case, job in zip(CASES, jobs):
        done, _ = _wait(wan_app, job["id"])
        assert done["status"] == "completed", done
        got = _result(wan_app, job["id"])
        got = Result(torch.from_numpy(got.latents), got.pixels)
        positive = assert_matches(got, reference(wan_pipe, case), case["prompt"])
        if case is CASES[0]:
            swapped = {"prompt": reference(wan_pipe, {**case, "prompt": CASES[3]["prompt"]}),
                       "seed": reference(wan_pipe, {**case, "seed": 9})}
            assert_swaps_fail(got, swapped, positive, "served wan " + case["prompt"])


def test_two_ingress_replicas_share_the_queue_and_answer_for_every_job(wan_app):
    jobs = [_create(wan_app, prompt=f"shared {i}", size="64x64", num_frames=9, num_inference_steps=30)
            for i in range(4)]
    for _ in range(10):  # the proxy spreads these over both replicas: each answers for every job
        assert all(httpx.get(f"{wan_app}/v1/videos/{j['id']}", timeout=30).status_code == 200 for j in jobs)
    for job in jobs:
        assert _wait(wan_app, job["id"])[0]["status"] == "completed"
    workers = _workers([j["id"] for j in jobs])
    assert len(set(workers)) == 2, workers  # four long jobs at once, at most two per replica: both ran some


def test_jobs_are_listed_by_pages(wan_app):
    ids = [_create(wan_app, prompt=f"page {i}", num_inference_steps=1)["id"] for i in range(3)]
    for video_id in ids:
        _wait(wan_app, video_id)
    page = httpx.get(wan_app + "/v1/videos?limit=2", timeout=30).json()
    assert page["object"] == "list" and len(page["data"]) == 2 and page["has_more"]
    assert [v["id"] for v in page["data"]] == ids[::-1][:2]  # newest first
    rest = httpx.get(f"{wan_app}/v1/videos?limit=2&after={page['last_id']}", timeout=30).json()
    assert rest["data"][0]["id"] == ids[0]
    oldest = httpx.get(wan_app + "/v1/videos?limit=1&order=asc", timeout=30).json()["data"][0]["id"]
    assert oldest < ids[0]  # the jobs of the tests before come first


def test_deleting_a_running_job_frees_its_stages(wan_app):
    job = _create(wan_app, prompt="a long one", num_frames=17, size="64x64", num_inference_steps=40)
    deadline = time.monotonic() + 120
    while httpx.get(f"{wan_app}/v1/videos/{job['id']}", timeout=30).json()["progress"] < 5:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = httpx.delete(f"{wan_app}/v1/videos/{job['id']}", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{wan_app}/v1/videos/{job['id']}", timeout=30).status_code == 404
    start = time.monotonic()
    assert not busy_stages(wan_app, timeout=30)
    print(f"stages idle {time.monotonic() - start:.1f} s after the delete")


BAD = [
    ({"prompt": "x", "size": "33x16"}, "size"), ({"prompt": "x", "seconds": "10"}, "seconds"),
    ({"prompt": "x", "num_frames": "6"}, "num_frames"), ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": ""}, "prompt"), ({"prompt": "x", "model": "sora-2"}, "model"),
    ({"prompt": "x", "num_inference_steps": "1000"}, "num_inference_steps"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_are_400s_in_openais_shape(wan_app, fields, param):
    r = httpx.post(wan_app + "/v1/videos", data={"model": MODEL, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_unknown_and_malformed_ids(wan_app):
    for method, path in (("GET", "/v1/videos/video_0123abc"), ("DELETE", "/v1/videos/video_0123abc"),
                         ("GET", "/v1/videos/video_0123abc/content")):
        r = httpx.request(method, wan_app + path, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"], (method, path, r.text)
    r = httpx.get(wan_app + "/v1/videos/not-an-id", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "video_id"
    queued = _create(wan_app, prompt="not yet", num_inference_steps=30, num_frames=17, size="64x64")
    r = httpx.get(f"{wan_app}/v1/videos/{queued['id']}/content", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "video_not_ready"
    httpx.delete(f"{wan_app}/v1/videos/{queued['id']}", timeout=30)


def test_a_reference_image_is_refused_by_text_to_video(wan_app):
    r = httpx.post(wan_app + "/v1/videos", data={"model": MODEL, "prompt": "x"},
                   files={"input_reference": ("f.png", b"\x89PNG\r\n\x1a\n", "image/png")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text


def test_another_keys_job_is_unknown_to_it(wan_app):
    """A job belongs to the API key that created it (a digest of the Authorization header): another key's retrieve,
    content and delete answer 404 as for an unknown id, and its list leaves the job out."""
    alice, bob = {"authorization": "Bearer alice"}, {"authorization": "Bearer bob"}
    r = httpx.post(wan_app + "/v1/videos", data={"model": MODEL, "prompt": "mine", "num_inference_steps": "1"},
                   headers=alice, timeout=60)
    assert r.status_code == 200, r.text
    job = r.json()["id"]
    for method, path in (("GET", f"/v1/videos/{job}"), ("GET", f"/v1/videos/{job}/content"),
                         ("DELETE", f"/v1/videos/{job}")):
        r = httpx.request(method, wan_app + path, headers=bob, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["message"], (method, path, r.text)
    assert job not in {v["id"] for v in httpx.get(wan_app + "/v1/videos", headers=bob, timeout=30).json()["data"]}
    assert job in {v["id"] for v in httpx.get(wan_app + "/v1/videos", headers=alice, timeout=30).json()["data"]}
    assert httpx.get(f"{wan_app}/v1/videos/{job}", headers=alice, timeout=30).status_code == 200
