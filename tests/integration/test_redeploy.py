"""A redeploy under load, the operator's way (``omni-serve build``, then ``serve deploy`` on a local Ray cluster with
its dashboard): closed-loop clients stream speech from the Omni graph and ask the image graph for 50-step images
while a redeploy changes one stage of each graph (the talker's and the DiT's CPUs). Every answer is a 200, no
connection resets, every stream ends in ``[DONE]``; only the changed stages' replicas were replaced (each graph's
other stages and its ingress keep theirs); the graph serves on after the roll."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import yaml

from tests.integration.local_cluster import BIN, DASHBOARD, HTTP_PORT, URL, applications, cli, local_cluster, \
    wait_running
from tests.integration.conftest import FIXED_TOPOLOGY

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OMNI, IMAGE = "omni_redeploy", "image_redeploy"
SPEECH = {"model": "qwen2.5-omni", "modalities": ["text", "audio"], "audio": {"voice": "Chelsie", "format": "pcm16"},
          "messages": [{"role": "user", "content": "tell me more"}], "max_tokens": 12, "min_tokens": 12,
          "temperature": 0, "stream": True}
IMAGE_REQUEST = {"model": "qwen-image", "prompt": "a red cat", "num_inference_steps": 50, "seed": 1}
CHANGED = {OMNI: "talker", IMAGE: "dit"}


def _config(omni_dir: str, image_dir: str, path, cpus: float) -> str:
    """One Serve config with both graphs; the talker's and the DiT's CPUs are ``cpus``."""
    from omni_serve.graph.serve_config import build_serve_config

    omni, _ = build_serve_config("qwen2_5_omni", {
        "checkpoint": omni_dir, **FIXED_TOPOLOGY, "stages.code2wav.params.num_steps": 4, "stages.talker.params.max_codec_tokens": 40,
        "stages.talker.num_cpus": cpus}, app_name=OMNI, route_prefix=f"/{OMNI}", host="127.0.0.1", port=HTTP_PORT)
    image, _ = build_serve_config("qwen_image", {
        "checkpoint": image_dir, "default_size": "64x64", "stages.dit.num_cpus": cpus},
        app_name=IMAGE, route_prefix=f"/{IMAGE}", host="127.0.0.1", port=HTTP_PORT)
    omni["applications"] += image["applications"]
    path.write_text(yaml.safe_dump(omni, sort_keys=False))
    return str(path)


def _replicas() -> dict[tuple[str, str], set[str]]:
    """(app, deployment) -> ids of its RUNNING replicas."""
    return {(app, name): {r["replica_id"] for r in d["replicas"] if r["state"] == "RUNNING"}
            for app, details in applications().items() for name, d in details["deployments"].items()}


def _speech(client: httpx.Client, out: list) -> None:
    try:
        with client.stream("POST", f"/{OMNI}/v1/chat/completions", json=SPEECH) as r:
            lines = [line for line in r.iter_lines() if line]
        ok = r.status_code == 200 and lines[-1:] == ["data: [DONE]"] and not any('"error"' in x for x in lines)
        out.append(("speech", r.status_code, ok, lines[-2:]))
    except httpx.HTTPError as exc:  # a reset or a cut stream
        out.append(("speech", None, False, repr(exc)))


def _image(client: httpx.Client, out: list) -> None:
    try:
        r = client.post(f"/{IMAGE}/v1/images/generations", json=IMAGE_REQUEST)
        out.append(("image", r.status_code, r.status_code == 200 and bool(r.json().get("data")), r.text[:300]))
    except httpx.HTTPError as exc:
        out.append(("image", None, False, repr(exc)))


@pytest.fixture(scope="module")
def deployed(omni_tiny_dir, qwen_image_tiny_dir, tmp_path_factory):
    with local_cluster(num_cpus=8):
        folder = tmp_path_factory.mktemp("redeploy")
        dirs = os.path.abspath(omni_tiny_dir), os.path.abspath(qwen_image_tiny_dir)
        first = _config(*dirs, folder / "first.yaml", cpus=0.5)
        deploy = cli(f"{BIN}/serve", "deploy", first, "-a", DASHBOARD)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        wait_running(OMNI)
        wait_running(IMAGE)
        yield _config(*dirs, folder / "second.yaml", cpus=0.4)


def test_a_redeploy_under_load_rolls_only_the_changed_stages_and_loses_nothing(deployed):
    before = _replicas()
    results: list = []
    stop = threading.Event()

    def loop(ask):
        with httpx.Client(base_url=URL, timeout=300) as client:
            while not stop.is_set():
                ask(client, results)

    clients = [threading.Thread(target=loop, args=(ask,)) for ask in (_speech, _speech, _image)]
    for c in clients:
        c.start()
    try:
        while len(results) < 3:  # the load is on before the redeploy
            time.sleep(0.2)
        deploy = cli(f"{BIN}/serve", "deploy", deployed, "-a", DASHBOARD)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        deadline = time.monotonic() + 300
        while True:  # the changed stages rolled: none of their old replicas runs, a new one does
            now = _replicas()
            if all(now[(app, stage)] and not now[(app, stage)] & before[(app, stage)] for app, stage in
                   CHANGED.items()):
                break
            assert time.monotonic() < deadline, f"the changed stages did not roll: {now}"
            time.sleep(1)
        during = len(results)
        while len(results) < during + 3:  # and the graphs serve on after the roll
            time.sleep(0.2)
    finally:
        stop.set()
        for c in clients:
            c.join(300)
    after = _replicas()
    failed = [r for r in results if not r[2]]
    print(f"{len(results)} requests ({sum(r[0] == 'speech' for r in results)} speech streams), "
          f"{len(failed)} failed")
    assert not failed, failed[:5]
    assert {r[0] for r in results} == {"speech", "image"}
    for key, ids in before.items():
        app, name = key
        if app not in CHANGED:
            continue
        if name == CHANGED[app]:
            assert not after[key] & ids, f"{key} kept an old replica"
        else:
            assert ids <= after[key], f"{key} lost replicas it had before the redeploy: {ids - after[key]}"
    wait_running(OMNI)
    wait_running(IMAGE)
