"""The served Wan image-to-video graph behind OpenAI's Videos API, over real HTTP with Ray: a job alone and jobs in
flight together (first frames, sizes, frame counts, steps, seeds) give the final latents of diffusers'
``WanImageToVideoPipeline`` within float rounding and its frames within a level (the ``npz`` output format), and the
comparison fails for a swapped image, prompt or seed; the official client's ``videos.create_and_poll`` with an
``input_reference`` file then ``download_content`` gives a playable MP4; a missing, unreadable or wrong-sized
reference is a 400 in OpenAI's shape. Restart: the ingress replica's process is killed (SIGKILL) while jobs run and
after another completed: once Serve replaced it every job is still listed, the completed one downloads, and the
running ones complete on a second attempt (their lease ran out) or fail with a clear error, and no stage is left
working for the dead replica."""

from __future__ import annotations

import io
import os
import signal
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.image_oracle import Result, assert_matches, assert_swaps_fail
from tests.integration.http_waits import busy_stages, wait_until
from tests.unit.test_wan_i2v_models import frame, reference

pytestmark = pytest.mark.integration
MODEL = "wan2.1-i2v"
APP = "wan_i2v"
STAGES = ("text_encoder", "image_encoder", "vae_encoder", "dit", "vae")
JOBS_DIR: list[str] = []  # the served graph's job store directory (its SQLite file), read by the restart test


@pytest.fixture(scope="module")
def i2v_app(ray_serve, wan_i2v_tiny_dir, tmp_path_factory):
    from ray import serve

    from omni_serve.families.wan_i2v import build_app

    jobs = tmp_path_factory.mktemp("wan_i2v_jobs")
    JOBS_DIR.append(str(jobs))
    serve.run(build_app({
        "checkpoint": wan_i2v_tiny_dir, "ingress.num_cpus": 0, **{f"stages.{s}.num_cpus": 0 for s in STAGES},
        "default_size": "32x16", "default_seconds": 1, "default_fps": 4, "default_steps": 3, "max_steps": 60,
        "max_frames": 17, "max_side": 64, "max_pixels": 64 * 64, "max_running_jobs": 4, "jobs.dir": str(jobs),
        "jobs.lease_s": 6.0}), name=APP, route_prefix="/wan_i2v")
    yield ray_serve + "/wan_i2v"
    serve.delete(APP)


@pytest.fixture(scope="module")
def i2v_pipe(wan_i2v_tiny_dir):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(wan_i2v_tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _png(pixels: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _post(base: str, reference_file: bytes | None, **fields) -> httpx.Response:
    files = {"input_reference": ("frame.png", reference_file, "image/png")} if reference_file is not None else None
    return httpx.post(base + "/v1/videos", data={"model": MODEL, **{k: str(v) for k, v in fields.items()}},
                      files=files, timeout=60)


def _create(base: str, case: dict, **extra) -> dict:
    fields = {"prompt": case["prompt"], "size": "{}x{}".format(*case["size"]), "num_frames": case["num_frames"],
              "num_inference_steps": case["steps"], "guidance_scale": case["guidance_scale"], "seed": case["seed"],
              "output_format": "npz", **extra}
    if "negative_prompt" in case:
        fields["negative_prompt"] = case["negative_prompt"]
    r = _post(base, _png(frame(case["image"], *case["size"])), **fields)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(base: str, video_id: str, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/videos/{video_id}", timeout=30).json()
        if job.get("status") in ("completed", "failed"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {video_id} did not end in {timeout_s} s: {job}")


def _result(base: str, video_id: str) -> Result:
    import torch

    r = httpx.get(f"{base}/v1/videos/{video_id}/content", timeout=60)
    assert r.status_code == 200, r.text[:200]
    archive = np.load(io.BytesIO(r.content))
    return Result(torch.from_numpy(archive["latents"][None]), archive["frames"][None])


CASES = [
    {"prompt": "a red cat", "image": 1, "size": (32, 16), "num_frames": 5, "steps": 3, "guidance_scale": 5.0,
     "seed": 1},
    {"prompt": "dog", "image": 2, "size": (32, 16), "num_frames": 5, "steps": 2, "guidance_scale": 1.0, "seed": 2},
    {"prompt": "a house by the sea at night", "image": 3, "size": (16, 32), "num_frames": 9, "steps": 4,
     "guidance_scale": 3.0, "negative_prompt": "blurry", "seed": 3},
    {"prompt": "green tree", "image": 4, "size": (32, 16), "num_frames": 5, "steps": 4, "guidance_scale": 4.0,
     "negative_prompt": "people", "seed": 4},
]


def test_one_job_alone_then_four_in_flight_equal_the_pipeline_and_swaps_fail(i2v_app, i2v_pipe):
    alone = _create(i2v_app, CASES[0])
    assert _wait(i2v_app, alone["id"])["status"] == "completed"
    assert_matches(_result(i2v_app, alone["id"]), reference(i2v_pipe, CASES[0]), "alone")
    jobs = [_create(i2v_app, case) for case in CASES]
    for case, job in zip(CASES, jobs):
        done = _wait(i2v_app, job["id"])
        assert done["status"] == "completed" and done["size"] == "{}x{}".format(*case["size"]), done
        got = _result(i2v_app, job["id"])
        positive = assert_matches(got, reference(i2v_pipe, case), case["prompt"])
        if case is CASES[0]:
            swapped = {"image": reference(i2v_pipe, {**case, "image": 9}),
                       "prompt": reference(i2v_pipe, {**case, "prompt": "sky"}),
                       "seed": reference(i2v_pipe, {**case, "seed": 9})}
            assert_swaps_fail(got, swapped, positive, "served wan i2v " + case["prompt"])


def test_the_official_client_sends_a_reference_and_downloads_a_playable_mp4(i2v_app):
    import av
    from openai import OpenAI

    oa = OpenAI(base_url=i2v_app + "/v1", api_key="unused")
    first = frame(7, 32, 16)
    video = oa.videos.create_and_poll(model=MODEL, prompt="a boat", seconds="1",
                                      input_reference=("first.png", _png(first), "image/png"), poll_interval_ms=100)
    assert video.status == "completed" and video.size == "32x16"  # the reference's size: size was left out
    with av.open(io.BytesIO(oa.videos.download_content(video.id).read())) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 5 and frames[0].shape == (16, 32, 3)


BAD = [
    (None, {}, "input_reference", "required"),
    (b"not an image", {}, "input_reference", ""),
    (_png(frame(1, 16, 32)), {"size": "32x16"}, "input_reference", "size"),
    (_png(frame(1, 24, 16)), {}, "size", "multiple"),
    (_png(frame(1, 32, 16)), {"num_frames": 6}, "num_frames", ""),
]


@pytest.mark.parametrize("reference_file, fields, param, words", BAD, ids=[f"{p}-{w}" for _, _, p, w in BAD])
def test_bad_references_are_400s_in_openais_shape(i2v_app, reference_file, fields, param, words):
    r = _post(i2v_app, reference_file, prompt="x", **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


def _ingress_pid() -> int | None:
    """The pid of the graph's ingress replica (Ray titles a replica's process ``ray::ServeReplica:APP:DEPLOYMENT``)."""
    import psutil

    found = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
             if any(f"ServeReplica:{APP}:ingress" in part for part in p.info["cmdline"] or ())]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_jobs_outlive_a_killed_ingress_replica(i2v_app):
    done = _create(i2v_app, {**CASES[1], "seed": 11})
    assert _wait(i2v_app, done["id"])["status"] == "completed"
    long = {**CASES[0], "size": (64, 64), "num_frames": 17, "steps": 60}
    running = [_create(i2v_app, {**long, "seed": s}) for s in (21, 22)]
    wait_until(lambda: all(httpx.get(f"{i2v_app}/v1/videos/{j['id']}", timeout=30).json()["progress"] > 0
                           for j in running), 180, "the long jobs did not start")
    pid = _ingress_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: _ingress_pid() not in (pid, None) and _listed(i2v_app) is not None, 180,
               "the ingress was not replaced", interval=0.5)
    print(f"ingress replaced {time.monotonic() - killed:.1f} s after the kill")
    listed = _listed(i2v_app)
    assert {done["id"], *(j["id"] for j in running)} <= listed
    assert _result(i2v_app, done["id"]).pixels.shape == (1, 5, 16, 32, 3)  # still downloads
    for job in running:
        ended = _wait(i2v_app, job["id"], timeout_s=600)
        assert ended["status"] == "completed" or ended["error"]["message"], ended
        print(f"{job['id']}: {ended['status']} {ended.get('error')} after {_attempts(job['id'])} attempts")
        assert _attempts(job["id"]) == 2  # the dead replica's attempt, then the one that ended it
    assert _attempts(done["id"]) == 1
    assert not busy_stages(i2v_app, timeout=60)  # nothing left running for the dead replica's requests


def _attempts(video_id: str) -> int:
    """How many times the job was claimed, from the graph's job database itself."""
    import sqlalchemy as sa

    engine = sa.create_engine("sqlite:///" + os.path.join(JOBS_DIR[0], "jobs.sqlite3"))
    try:
        with engine.connect() as db:
            return db.execute(sa.text("SELECT attempts FROM jobs WHERE id = :id"), {"id": video_id}).scalar_one()
    finally:
        engine.dispose()


def _listed(base: str) -> set[str] | None:
    try:
        r = httpx.get(base + "/v1/videos?limit=100", timeout=10)
    except httpx.HTTPError:
        return None
    return {v["id"] for v in r.json()["data"]} if r.status_code == 200 else None
