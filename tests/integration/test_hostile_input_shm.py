"""Hostile local processes against the shared-memory data plane of a served graph.

The Qwen-Image graph is served with both its edges (text_encoder -> dit, dit -> vae) on ``shm``. While it
serves, a *planter* process watches this node's shared-memory tree for the request ids the server is
using and plants forged index files where the server is about to read: a pickle that would create a marker
file when unpickled (plain, and inside the old index layout), JSON index files pointing at a segment of its
own outside the tree (by path, or through a link planted in a fake pool), one naming ``posix.system`` as a
message class, and a symlink to its own index file.

- Another user (uid 65534; needs root to switch to it) cannot even list the tree: it plants nothing, and
  every request returns the same image as without it.
- A process of the serving user itself (the worst case: it can write the tree) gets its files read as
  nothing but data: none is unpickled (the marker never appears), its segment is never mapped (its state
  byte stays 1), each request returns the same image as without it or a clean 500, and the server keeps
  answering once it stops.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import IMAGE_APP_ARGS

pytestmark = pytest.mark.integration

EDGES = ("text_encoder_dit", "dit_vae")
REQUESTS = [{"prompt": f"a hostile test {i}", "seed": i, "num_inference_steps": 3, "size": "64x64"} for i in range(4)]

PLANTER = r"""
import json, os, pickle, sys, time

keys, marker, own_dir, out, edges = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5].split(",")

class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

evil = pickle.dumps(Evil())
with open(os.path.join(own_dir, "evil.pickle"), "wb") as f:  # for the test's control
    f.write(evil)
tensor = {"v": 1, "p": {"M": "omni_serve.kits.diffusion.messages.FinalLatents",
                        "F": {"latents": {"T": ["float32", [1, 16, 64], 0, False]}}}}
index = lambda pool, payload: json.dumps({"v": 1, "pool": pool, "seg": 1, "nbytes": 4096, "payload": payload}).encode()
own_index = os.path.join(own_dir, "index")
fd = os.open(own_index, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
os.write(fd, index("1-deadbeef", tensor))  # its segment, through the fake pool's link
os.close(fd)
forged = [
    evil,
    pickle.dumps((None, 0, evil)),  # the old index layout, the payload's pickle inside
    index("../../../../../.." + own_dir, tensor),  # its own segment, outside the tree
    index(os.path.join(own_dir, "seg.1"), tensor),
    json.dumps({"v": 1, "pool": None, "seg": None, "nbytes": 0,
                "payload": {"v": 1, "p": {"M": "posix.system", "F": {"command": f"touch {marker}"}}}}).encode(),
    None,  # a symlink to its own index file
]
stats = {"planted": 0, "denied": 0, "requests": []}
n = 0
fake_pool = os.path.join(os.path.dirname(keys), "pools", "1-deadbeef")  # its index file's pool: a link to its segment
while not os.path.exists(os.path.join(own_dir, "stop")):
    try:
        os.makedirs(fake_pool, exist_ok=True)
        os.symlink(os.path.join(own_dir, "seg.1"), os.path.join(fake_pool, "seg.1"))
    except OSError:
        pass  # there already, or not allowed
    try:
        rids = os.listdir(keys)
    except OSError:
        stats["denied"] += 1
        time.sleep(0.01)
        continue
    for rid in rids:
        if rid not in stats["requests"]:
            stats["requests"].append(rid)
        for edge in edges:
            path = os.path.join(keys, rid, edge, "0")
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                if forged[n % len(forged)] is None:
                    os.symlink(own_index, path)
                else:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    os.write(fd, forged[n % len(forged)])
                    os.close(fd)
                stats["planted"] += 1
                n += 1
            except OSError:
                stats["denied"] += 1  # there already (the real payload, or ours), or not allowed
    time.sleep(0.0005)
with open(out, "w") as f:
    json.dump(stats, f)
"""


@pytest.fixture(scope="module")
def client(ray_serve, qwen_image_tiny_dir):
    """A client of the Qwen-Image graph served with both edges on shared memory."""
    from ray import serve

    from omni_serve.families.qwen_image import build_app

    args = {"checkpoint": qwen_image_tiny_dir, "default_size": "64x64", "default_steps": 4, "ingress.num_cpus": 0,
            **IMAGE_APP_ARGS, **{f"edges.{e}.connector": "shm" for e in EDGES}}
    serve.run(build_app(args), name="qwen_image_shm", route_prefix="/image_shm")
    with httpx.Client(base_url=ray_serve + "/image_shm", timeout=180) as c:
        yield c
    serve.delete("qwen_image_shm")


def image(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


@pytest.fixture(scope="module")
def baseline(client) -> list[bytes]:
    """Each request's image with nobody interfering."""
    return [image(client.post("/v1/images/generations", json={"model": "qwen-image", **r})) for r in REQUESTS]


class Planter:
    """The planter script in its own process (as ``user``, or as this user), with a world-writable scratch dir."""

    def __init__(self, user: int | None = None):
        from omni_serve.transport.shm import tree_path

        python = python_for(user)
        self.dir = Path(tempfile.mkdtemp(prefix="planter-", dir="/tmp"))
        self.dir.chmod(0o777)  # the other user writes its files and stats here
        self.marker, self.out = self.dir / "pwned", self.dir / "stats.json"
        self.segment = self.dir / "seg.1"  # its own segment: state byte 1, then float32 garbage
        self.segment.write_bytes(b"\x01" + bytes(63) + b"\x7f" * 4096)
        os.chmod(self.segment, 0o600 if user is None else 0o666)  # private: as a segment of ours would be
        self.keys = tree_path() / "keys"
        self.proc = subprocess.Popen(
            [python, "-c", PLANTER, str(self.keys), str(self.marker), str(self.dir), str(self.out),
             ",".join(EDGES)], user=user, group=user, extra_groups=[] if user is not None else None,
            stderr=subprocess.PIPE)

    def stop(self) -> dict:
        (self.dir / "stop").touch()
        _, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err.decode()[-2000:]
        return json.loads(self.out.read_text())

    def cleanup(self, stats: dict) -> None:
        """Remove what it planted in the requests it touched (the server freed their real payloads), and its
        scratch dir."""
        for rid in stats["requests"]:
            for edge in EDGES:
                path = self.keys / rid / edge / "0"
                if path.is_symlink() or path.exists():
                    path.unlink()
                with contextlib.suppress(OSError):
                    path.parent.rmdir()
            with contextlib.suppress(OSError):
                (self.keys / rid).rmdir()
        shutil.rmtree(self.keys.parent / "pools" / "1-deadbeef", ignore_errors=True)  # its fake pool
        shutil.rmtree(self.dir, ignore_errors=True)


def python_for(user: int | None) -> str:
    """An interpreter ``user`` can run (the planter needs the standard library only)."""
    if user is None:
        return sys.executable
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if _runs(python, user):
            return python
    pytest.skip(f"no Python interpreter uid {user} may run")


def _runs(python: str, user: int) -> bool:
    try:
        return subprocess.run([python, "-c", "pass"], user=user, group=user, extra_groups=[],
                              capture_output=True, timeout=60).returncode == 0
    except OSError:
        return False


def run_requests(client) -> list[httpx.Response]:
    return [client.post("/v1/images/generations", json={"model": "qwen-image", **r}) for r in REQUESTS]


def test_the_tree_is_private_to_the_serving_user(client, baseline):
    from omni_serve.transport.shm import tree_path

    root = tree_path()
    st = os.lstat(root)
    assert root.name == f"omni_serve.{os.geteuid()}.omni_serve" and st.st_uid == os.geteuid()
    assert st.st_mode & 0o777 == 0o700, oct(st.st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")
def test_another_user_cannot_reach_the_tree(client, baseline):
    planter = Planter(user=65534)
    try:
        images = [image(r) for r in run_requests(client)]
    finally:
        stats = planter.stop()
        planter.cleanup(stats)
    assert stats["planted"] == 0 and stats["denied"] > 0 and not stats["requests"], stats
    assert images == baseline


def test_files_planted_by_a_process_of_the_serving_user_are_never_executed_nor_read(client, baseline):
    planter = Planter()
    try:
        responses = run_requests(client)
    finally:
        stats = planter.stop()
    try:
        assert stats["planted"] > 0, stats  # it did reach the requests the server was running
        assert not planter.marker.exists(), "a planted pickle was unpickled"
        assert planter.segment.read_bytes()[0] == 1, "a reader mapped the planted segment"
        check_outcomes(client, responses, baseline, stats)
        # the control: the planted pickle was live ammunition
        evil = (planter.dir / "evil.pickle").read_bytes()
        subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
                       input=evil, check=True, timeout=60)
        assert planter.marker.exists()
    finally:
        planter.cleanup(stats)


def check_outcomes(client, responses, baseline, stats) -> None:
    outcomes = []
    for r, expected in zip(responses, baseline):
        if r.status_code == 200:
            assert image(r) == expected  # the real payload, not the planted one
            outcomes.append("same image")
        else:
            assert r.status_code == 500 and r.json()["error"]["message"], r.text
            outcomes.append(f"500: {r.json()['error']['message'][:120]}")
    print("outcomes under a same-user planter:", outcomes, stats["planted"], "files planted")
    # and the server keeps answering, with the same images
    assert [image(r) for r in run_requests(client)] == baseline
