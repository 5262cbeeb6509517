"""The Qwen-Image graph on a cluster that grows (``tests/multinode/conftest.py``): served from the head alone, then
two nodes join and the graph is redeployed onto them (the DiT on a node of its own, text encoder, VAE and ingress on
the other) while requests keep coming; every request is served, equal to diffusers. Across nodes the text encoder's
stream goes over Mooncake's Transfer Engine and the DiT's over a ``mooncake_store`` edge whose master omni_serve
started itself (default settings: on the head, at its IP)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Iterator

import httpx
import pytest

from tests.image_oracle import assert_matches, assert_swaps_fail, pipeline_result, response_result
from tests.multinode.conftest import start_cluster, stop_cluster, wait_until

pytestmark = pytest.mark.multinode

MODEL = "qwen-image"
CASE = {"prompt": "a red cat under a blue sky", "seed": 1, "num_inference_steps": 4}
SWAPPED = {"prompt": {**CASE, "prompt": "dog"}, "seed": {**CASE, "seed": 2}}
DIT, IMAGE = "omni_dit", "omni_image"


@pytest.fixture(scope="module")
def pipe(qwen_image_tiny_dir):
    from diffusers import QwenImagePipeline

    p = QwenImagePipeline.from_pretrained(qwen_image_tiny_dir)
    p.set_progress_bar_config(disable=True)
    return p


_REFERENCES: dict[str, object] = {}


def reference(pipe, case):
    """diffusers' result for ``case``, computed once (every response is checked against the same few)."""
    key = json.dumps(case, sort_keys=True)
    if key not in _REFERENCES:
        _REFERENCES[key] = pipeline_result(pipe, case["seed"], prompt=case["prompt"], true_cfg_scale=4.0, width=64,
                                           height=64, num_inference_steps=case["num_inference_steps"])
    return _REFERENCES[key]


@pytest.fixture(scope="module")
def cluster(qwen_image_tiny_dir):
    c = start_cluster([{}])
    c.args = {"checkpoint": os.path.abspath(qwen_image_tiny_dir), "default_size": "64x64", "default_steps": 4,
              "edges.dit_vae.connector": "mooncake_store"}
    try:
        c.deploy("qwen_image", c.args, name="qwen_image", route_prefix="/")
        yield c
    finally:
        stop_cluster(c)


def generate(http, case=CASE):
    return http.post("/v1/images/generations", json={"model": MODEL, **case, "return_latents": True})


def check(pipe, r) -> None:
    assert r.status_code == 200, r.text
    got = response_result(r.json()["data"])
    positive = assert_matches(got, reference(pipe, CASE), "served")
    assert_swaps_fail(got, {k: reference(pipe, case) for k, case in SWAPPED.items()}, positive, "served")


def test_served_from_the_head_alone(cluster, http, pipe):
    check(pipe, generate(http))
    stages = http.get("/health?fresh=1").json()["stages"]
    assert {s["node_ip"] for s in stages.values()} == {cluster.ip("head")}


@contextlib.contextmanager
def asking(cluster) -> Iterator[list]:
    """One client asking for images in a closed loop while the block runs; yields the responses so far."""
    results, stop = [], threading.Event()

    def keep_asking():
        with httpx.Client(base_url=cluster.url, timeout=300) as client:
            while not stop.is_set():
                results.append(generate(client))

    asker = threading.Thread(target=keep_asking)
    asker.start()
    try:
        yield results
    finally:
        stop.set()
        asker.join(300)


def test_two_nodes_join_and_the_graph_moves_onto_them_while_serving(cluster, http, pipe):
    cluster.join("worker1", {DIT: 10})
    cluster.join("worker2", {IMAGE: 10})
    with asking(cluster) as results:
        cluster.deploy("qwen_image", {
            **cluster.args, "stages.dit.resources": {DIT: 1},
            "stages.text_encoder.resources": {IMAGE: 1}, "stages.vae.resources": {IMAGE: 1},
            # the ingress too: no omni_serve process is left on the head to sweep its /dev/shm, so what the
            # replicas that left it had put must go with them (the last test looks)
            "ingress.resources": {IMAGE: 1},
        }, name="qwen_image", route_prefix="/")
        wait_until(lambda: len(results) >= 2, 300, 0.5, "requests after the redeploy")
    print(f"{len(results)} requests during and after the move")
    for r in results:
        check(pipe, r)
    stages = http.get("/health?fresh=1").json()["stages"]
    assert stages["dit"]["node_ip"] == cluster.ip("worker1")
    assert stages["text_encoder"]["node_ip"] == stages["vae"]["node_ip"] == cluster.ip("worker2")


def test_cross_node_edges_use_the_transfer_engine_and_a_store_with_a_master_every_node_reaches(cluster, http, pipe):
    check(pipe, generate(http))
    stages = http.get("/health?fresh=1").json()["stages"]
    reads = {r["edge"]: r for s in stages.values() for r in s["routes"] if r["side"] == "get"}
    route = reads["text_encoder_dit"]
    assert route["backend"] == "mooncake", route
    assert route["producer"]["ip"] == cluster.ip("worker2") and route["reader"]["ip"] == cluster.ip("worker1")
    # dit -> vae names mooncake_store: both sides set up against the master omni_serve started on the head
    assert stages["dit"]["data_plane"].get("mooncake_store") is not None, stages["dit"]["data_plane"]
    assert stages["vae"]["data_plane"].get("mooncake_store") is not None, stages["vae"]["data_plane"]


SHM_ACROSS_NODES = """
import asyncio
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class Side:
    async def put(self, key):
        from omni_serve.transport.connectors import get_connector
        await get_connector("shm").put(key, {{"x": torch.ones(4)}})

    async def free(self, request_id):
        from omni_serve.transport.connectors import get_connector
        await get_connector("shm").free_request(request_id)

    async def get(self, key):
        from omni_serve.transport.connectors import get_connector
        try:
            await get_connector("shm").get(key, 30)
        except Exception as exc:
            return type(exc).__name__ + ": " + str(exc)
        return "read"


def on(ip):
    node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == ip)
    return ray.remote(num_cpus=0)(Side).options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()


producer, consumer = on("{producer}"), on("{consumer}")
ray.get(producer.put.remote("shm-across/e/0"))
out = ray.get(consumer.get.remote("shm-across/e/0"))
ray.get(producer.free.remote("shm-across"))
print(json.dumps(out))
"""


def test_an_edge_named_shm_across_nodes_fails_with_the_documented_error(cluster):
    out = json.loads(cluster.python_in("head", SHM_ACROSS_NODES.format(producer=cluster.ip("worker1"),
                                                                        consumer=cluster.ip("worker2"))))
    assert out.startswith("DataPlaneError") and "use connector 'mooncake' or 'ray'" in out, out


def test_a_draining_node_hands_its_stage_over_and_every_request_finishes(cluster, http, pipe):
    """What the chart's preStop hook does before ``ray stop``: ``omni-serve drain-node`` on the DiT's node while
    requests keep coming; Serve starts the DiT on the node that joined and stops the old replica once the requests
    it holds are done; the hook returns once no replica is left there; no request fails."""
    cluster.join("worker3", {DIT: 10})
    with asking(cluster) as results:
        wait_until(lambda: results, 120, 0.2, "a request before the drain")
        drain = cluster.h.run_in(cluster.state.node("worker1"), [
            cluster.python, "-m", "omni_serve.cli", "drain-node", "--deadline-s", "420", "--poll-s", "0.5",
            "--address", f"{cluster.ip('head')}:{cluster.h.RAY_PORT}"], capture=True, timeout=480)
        during = len(results)
        wait_until(lambda: len(results) >= during + 2, 120, 0.5, "requests after the drain")
    print(drain.stdout)
    assert drain.returncode == 0 and "drained" in drain.stdout, (drain.stdout, drain.stderr[-3000:])
    print(f"{len(results)} requests before, during and after the drain")
    assert [r.status_code for r in results] == [200] * len(results), [r.text for r in results if r.status_code != 200]
    check(pipe, results[0])
    expected = reference(pipe, CASE)
    for i, r in enumerate(results):
        assert_matches(response_result(r.json()["data"]), expected, f"request {i}")
    assert http.get("/health?fresh=1").json()["stages"]["dit"]["node_ip"] == cluster.ip("worker3")
    cluster.power_off("worker1")  # the pod goes (ray stop): nothing of the graph was left on it
    check(pipe, generate(http))


def test_nothing_of_the_finished_requests_stays_on_any_node_or_in_the_directory(cluster, http):
    alive = [n.name for n in cluster.state.nodes if n.pid is not None]
    wait_until(lambda: not cluster.shm_leftovers(alive), 60, 2.0, "every node's /dev/shm emptied")
    wait_until(lambda: cluster.directory_keys() == [], 90, 3.0, "the data directory emptied")
