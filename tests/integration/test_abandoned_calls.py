"""A stage call whose cancel got lost stops once the ingress marks its request abandoned
(``omni_serve.graph.abandoned``): on the served image graph, a VAE call for a request whose latents never come
(what a call left behind by a lost cancel waits for) ends soon after the mark, not at its data timeout, with
its engine request gone; an unmarked one keeps waiting (the control); the marks add no directory entry."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.integration


def test_a_call_of_an_abandoned_request_stops_and_an_unmarked_one_waits_on(image_app):
    import httpx
    from ray import serve

    from omni_serve.graph.abandoned import CHECK_PERIOD_S, mark_abandoned
    from omni_serve.kits.diffusion.messages import DecodeCall

    def vae() -> dict:
        return httpx.get(f"{image_app}/health?fresh=1", timeout=30).json()["stages"]["vae"]

    from tests.integration.http_waits import ray_directory_size

    handle = serve.get_deployment_handle("vae", app_name="qwen_image")
    before, entries = vae()["abandoned_calls_cancelled"], ray_directory_size()

    def call(request_id: str):
        gen = handle.options(stream=True).generate.remote(DecodeCall(request_id=request_id, height=64, width=64))
        try:
            return list(gen)
        except BaseException as exc:  # noqa: BLE001 - what ended it is the result
            return exc

    with ThreadPoolExecutor(2) as pool:
        # ids of their own: a mark lives a TTL in the session's directory (a rerun must not meet the last one's)
        gone, waiting = f"abandoned-{uuid.uuid4().hex[:8]}", f"waiting-{uuid.uuid4().hex[:8]}"
        marked, unmarked = pool.submit(call, gone), pool.submit(call, waiting)
        time.sleep(CHECK_PERIOD_S)  # both calls are in the replica, waiting for latents
        mark_abandoned(gone)
        start = time.monotonic()
        ended = marked.result(timeout=120)  # its data timeout is the request deadline: 300 s
        took = time.monotonic() - start
        assert isinstance(ended, BaseException), ended
        assert not unmarked.done(), unmarked.result()  # 3+ periods on, the control still waits
        state = vae()
        assert state["abandoned_calls_cancelled"] == before + 1, state
        mark_abandoned(waiting)  # and it ends the same way
        assert isinstance(unmarked.result(timeout=120), BaseException)
    deadline = time.monotonic() + 30
    while (state := vae())["active"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert state["active"] == 0 and state["abandoned_calls_cancelled"] == before + 2, state
    assert ray_directory_size() <= entries  # the marks are not payload entries (leak checks count those)
    print(f"the abandoned call ended {took:.1f} s after the mark (check period {CHECK_PERIOD_S:g} s)")


def test_a_request_past_its_deadline_is_marked_abandoned_by_the_ingress(image_app):
    """The ingress side over Serve: a request that ends with its calls open (a 504 here) is marked."""
    import re

    import httpx
    import ray

    from omni_serve import settings
    from omni_serve.transport.directory import DIRECTORY_NAME

    r = httpx.post(f"{image_app}/v1/images/generations", headers={"X-Request-Timeout": "0.05"}, timeout=60,
                   json={"model": "qwen-image", "prompt": "a cat", "num_inference_steps": 4})
    assert r.status_code == 504, r.text
    request_id = re.search(r"\(request ([^)\s]+)\)", r.json()["error"]["message"]).group(1)
    directory = ray.get_actor(DIRECTORY_NAME, namespace=settings.RAY_NAMESPACE)
    deadline = time.monotonic() + 10  # the mark is sent without waiting for it
    while not (marked := ray.get(directory.abandoned_among.remote([request_id, "never-seen"]))):
        assert time.monotonic() < deadline, f"request {request_id} was not marked abandoned"
        time.sleep(0.2)
    assert marked == [request_id]
