"""The shared-memory data plane's trust boundary (no Ray): a private tree, private files, no links followed,
and nothing read off tmpfs is ever unpickled or allowed to point outside the tree."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import stat
import subprocess
import sys
import threading

import pytest
import torch

from omni_serve.graph.messages import StreamChunk
from omni_serve.transport import shm
from omni_serve.transport.codec import RefusedPayload, UnsupportedPayload
from omni_serve.transport.shm import SharedMemoryConnector, UnsafeSharedMemory, tree_path
from tests.unit.test_transport_shm import connector, shm_root  # noqa: F401 - the fixture

run = asyncio.run


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def index_path(c: SharedMemoryConnector, key: str) -> str:
    return c._index_path(key)


# -- the tree ------------------------------------------------------------------------------------------------
def test_tree_is_private_with_the_uid_in_its_name_and_every_file_is_0600(shm_root):
    c = connector(shm_root)
    root = tree_path(shm_root)
    assert root.name == f"omni_serve.{os.geteuid()}.omni_serve" and c.root == root
    assert [mode(root / d) for d in ("", "pools", "keys")] == [0o700] * 3

    async def main():
        await c.put("r/e/0", {"x": torch.ones(4)})
        await c.put("r/e/1", {"codes": [1]})  # no segment: the index file is the payload
    run(main())
    stream = root / "keys/r/e"
    files = [stream / "0", stream / "1", stream / "producer", c.pool.dir / "lock", c.pool.dir / "seg.1"]
    assert {str(f): mode(f) for f in files} == {str(f): 0o600 for f in files}
    assert [mode(d) for d in (root / "keys/r", stream, c.pool.dir)] == [0o700] * 3
    index = json.loads((stream / "0").read_bytes())  # JSON all the way: nothing to unpickle
    assert {k: v for k, v in index.items() if k != "payload"} == {"v": 1, "pool": c.pool.id, "seg": 1, "nbytes": 64}
    assert index["payload"] == {"v": 1, "p": {"D": [["x", {"T": ["float32", [4], 0, False]}]]}}


@pytest.mark.parametrize("fault", ["mode", "owner", "symlink", "file", "subdir", "parent"])
def test_an_unsafe_tree_is_refused_naming_the_path_and_the_fault(shm_root, tmp_path, monkeypatch, fault):
    root = tree_path(shm_root)
    shm_root.mkdir()
    bad, match = root, None
    if fault == "mode":
        root.mkdir(mode=0o700)
        root.chmod(0o777)
        match = "mode is 0777: group or others"
    elif fault == "owner":  # a tree another user made: simulated by running as another uid than its owner's
        real = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: real + 4242)
        bad = root = tree_path(shm_root)
        root.mkdir(mode=0o700)
        match = f"owned by uid {real}, not by this process' uid {real + 4242}"
    elif fault == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        root.symlink_to(tmp_path / "elsewhere")
        match = "it is a symlink"
    elif fault == "file":
        root.write_text("")
        match = "not a directory"
    elif fault == "subdir":
        root.mkdir(mode=0o700)
        (root / "keys").mkdir(mode=0o755)
        bad, match = root / "keys", "mode is 0755"
    elif fault == "parent":
        shm_root.chmod(0o777)
        bad, match = shm_root, "writable by group or others without the sticky bit"
    with pytest.raises(UnsafeSharedMemory, match=match) as info:
        connector(shm_root)
    assert f"refusing to use {bad}:" in str(info.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_tree_chowned_to_another_user_is_refused(shm_root):
    connector(shm_root)
    os.chown(tree_path(shm_root), 65534, 65534)
    with pytest.raises(UnsafeSharedMemory, match="owned by uid 65534"):
        connector(shm_root)


def test_a_shared_sticky_parent_such_as_dev_shm_is_fine(shm_root):
    shm_root.mkdir()
    shm_root.chmod(0o1777)
    connector(shm_root)


# What kubelet gives a pod for an `emptyDir` with `medium: Memory`: a tmpfs mount point owned by root, mode 0777
# (2777, group fsGroup, when the pod sets fsGroup, as the chart does), no sticky bit.
KUBELET_MODES = {"no fsGroup": "chmod 0777 {d}", "fsGroup 100": "chown 0:100 {d} && chmod 2777 {d}"}
ROUND_TRIP = """
import asyncio, sys, torch
from omni_serve.transport.shm import SharedMemoryConnector
c = SharedMemoryConnector(root=sys.argv[1])
async def main():
    await c.put("r/e/0", {"x": torch.arange(6.0)})
    got = await c.get("r/e/0", timeout=5)
    print("ROUND TRIP", got["x"].tolist())
asyncio.run(main())
"""


def in_mount_namespace(setup: str, root: str) -> subprocess.CompletedProcess:
    """Run ``setup`` then the round trip in a mount namespace of its own (the mounts vanish with it)."""
    script = f"{setup} && exec {sys.executable} -c '{ROUND_TRIP}' {root}"
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=120, cwd=os.getcwd(),
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs (kubelet's emptyDir) needs root")
@pytest.mark.parametrize("modes", list(KUBELET_MODES))
def test_a_kubelet_memory_volume_is_accepted(tmp_path, modes):
    volume = tmp_path / "dev-shm"
    volume.mkdir()
    setup = f"mount -t tmpfs -o size=64m tmpfs {volume} && {KUBELET_MODES[modes].format(d=volume)}"
    proc = in_mount_namespace(setup, str(volume))
    assert proc.returncode == 0 and "ROUND TRIP [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in proc.stdout, proc.stderr[-2000:]
    assert "a Kubernetes emptyDir" in proc.stderr  # accepted, and said so


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_the_same_modes_on_a_mount_point_that_is_not_tmpfs_are_refused(tmp_path):
    volume = tmp_path / "dev-shm"
    volume.mkdir()
    # ramfs: a root-owned 0777 mount point like kubelet's, but not tmpfs (whatever file system /tmp is here)
    proc = in_mount_namespace(f"mount -t ramfs ramfs {volume} && chmod 0777 {volume}", str(volume))
    assert proc.returncode != 0 and "writable by group or others without the sticky bit" in proc.stderr


# -- links planted where the connector reads or writes ---------------------------------------------------------
def test_a_symlink_planted_as_an_index_file_is_not_followed(shm_root, tmp_path):
    async def main():
        producer, consumer = connector(shm_root), connector(shm_root)
        await producer.put("r/e/0", {"x": torch.arange(3.0)})
        # a well-formed index file moved outside the tree, a link to it in its place: followed, it would be read
        outside = tmp_path / "outside-index"
        os.rename(index_path(producer, "r/e/0"), outside)
        os.symlink(outside, index_path(producer, "r/e/0"))
        with pytest.raises(RefusedPayload, match="r/e/0 refused: .* is a symlink"):
            await consumer.get("r/e/0", 1)
        assert outside.exists()
    run(main())


def test_a_symlink_planted_as_the_producer_marker_is_not_written_through(shm_root, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")

    async def main():
        c = connector(shm_root)
        stream = os.path.dirname(index_path(c, "r/e/0"))
        os.makedirs(stream)
        os.symlink(victim, f"{stream}/producer")
        await c.put("r/e/0", {"x": torch.ones(2)})
        assert victim.read_text() == "precious"
        assert not os.path.islink(f"{stream}/producer") and c._producer_of(stream) == c.pool.id
        os.unlink(f"{stream}/producer")
        os.symlink(victim, f"{stream}/producer")  # a link read as the marker: no producer known, nothing read
        assert c._producer_of(stream) is None
    run(main())


def test_a_symlink_planted_as_a_segment_is_not_mapped(shm_root, tmp_path):
    async def main():
        producer = connector(shm_root)
        await producer.put("r/e/0", {"x": torch.arange(3.0)})
        seg = producer.pool.segments[0].path
        os.rename(seg, tmp_path / "seg-copy")
        os.symlink(tmp_path / "seg-copy", seg)
        with pytest.raises(RefusedPayload, match="is a symlink"):
            await connector(shm_root).get("r/e/0", 1)
    run(main())


# -- forged index files, planted by another process ------------------------------------------------------------
PLANT = r"""
import os, pickle, sys
path, marker = sys.argv[1], sys.argv[2]

class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

os.makedirs(os.path.dirname(path), exist_ok=True)
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private, ours: only its bytes are wrong
os.write(fd, pickle.dumps((None, 0, pickle.dumps(Evil()))) if sys.argv[3] == "nested" else pickle.dumps(Evil()))
os.close(fd)
"""


def plant(path: str, marker, how: str = "plain") -> bytes:
    subprocess.run([sys.executable, "-c", PLANT, path, str(marker), how], check=True, timeout=60)
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("how", ["plain", "nested"])
def test_a_malicious_pickle_planted_by_another_process_is_never_unpickled(shm_root, tmp_path, how):
    """``nested``: the old index layout (segment, size, pickled header), the payload's pickle inside."""
    marker = tmp_path / "pwned"

    async def main():
        c = connector(shm_root)
        await c.put("r/e/0", {"x": torch.ones(2)})  # the stream exists; chunk 1 is forged
        planted = plant(index_path(c, "r/e/1"), marker, how)
        with pytest.raises(RefusedPayload, match="r/e/1 refused: index file .* is not JSON"):
            await c.get("r/e/1", 1)
        for key in ("r/e/2", "r/e/3"):  # the freeing paths read index files too
            plant(index_path(c, key), marker, how)
        await c.free("r/e/2")
        await c.free_request("r")
        assert not os.path.exists(index_path(c, "r/e/3"))
        return planted
    planted = run(main())
    assert not marker.exists()
    # the control: these bytes do run code in whoever unpickles them
    subprocess.run([sys.executable, "-c", "import pickle, sys; x = pickle.loads(open(sys.argv[1], 'rb').read());"
                    "pickle.loads(x[2]) if isinstance(x, tuple) else None", "/dev/stdin"],
                   input=planted, check=True, timeout=60)
    assert marker.exists()


def forge(path: str, loc: dict, header: bytes, mode_: int = 0o600) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode_)
    os.write(fd, json.dumps({**loc, "payload": json.loads(header)}).encode())
    os.close(fd)


def test_forged_json_index_files_are_refused(shm_root, tmp_path):
    """Index files that parse but point outside the tree, name what is not a message, or are not ours."""
    own_segment = tmp_path / "attacker-seg"
    own_segment.write_bytes(b"\x01" + bytes(shm.HEADER - 1) + torch.full((16,), 6.66).numpy().tobytes())
    tensor = json.dumps({"v": 1, "p": {"x": {"T": ["float32", [16], 0, False]}}}).encode()
    no_seg = {"v": 1, "pool": None, "seg": None, "nbytes": 0}

    async def main():
        c = connector(shm_root)
        await c.put("r/e/0", {"x": torch.ones(2)})
        pid = c.pool.id
        cases = {
            "r/e/1": ({"v": 1, "pool": f"../../../../../..{own_segment.parent}", "seg": 1, "nbytes": 64}, tensor,
                      "bad segment"),
            "r/e/2": ({"v": 1, "pool": str(own_segment), "seg": 1, "nbytes": 64}, tensor, "bad segment"),
            "r/e/3": ({"v": 1, "pool": pid, "seg": "1/../../../x", "nbytes": 64}, tensor, "bad segment"),
            "r/e/4": ({"v": 1, "pool": pid, "seg": 1, "nbytes": 64, "path": str(own_segment)}, tensor,
                      "not an index file"),
            "r/e/5": (no_seg, json.dumps({"v": 1, "p": {"M": "subprocess.Popen", "F": {"args": "id"}}}).encode(),
                      "not a message class known"),
            "r/e/6": (no_seg, json.dumps({"v": 1, "p": {"M": f"{StreamChunk.__module__}.StreamChunk",
                                                        "F": {"end": "yes"}}}).encode(), "invalid .*StreamChunk"),
            "r/e/7": ({"v": 1, "pool": pid, "seg": 1, "nbytes": 1 << 30}, tensor, "has .* bytes, the index names"),
        }
        for key, (loc, header, _) in cases.items():
            forge(index_path(c, key), loc, header)
        forge(index_path(c, "r/e/8"), no_seg, b'{"v":1,"p":null}', mode_=0o644)
        cases["r/e/8"] = (None, None, "mode 0644, not a private file")
        for key, (_, _, match) in cases.items():
            with pytest.raises(RefusedPayload, match=match):
                await c.get(key, 1)
        assert own_segment.read_bytes()[0] == 1  # never mapped and released by a reader
        assert (await c.get("r/e/0", 1))["x"].sum() == 2  # the real payload is still served
    run(main())


def test_a_fifo_planted_as_an_index_file_does_not_block_the_reader(shm_root):
    """Opening a FIFO for reading waits for a writer: a reader that did would hang its stage. A watchdog
    unblocks such a reader after 5 s (so the test ends either way) and records that it had to."""
    stop, unblocked = threading.Event(), []

    def watchdog(stream: str) -> None:
        if not stop.wait(5):
            for path in glob.glob(f"{stream}/.claimed-*"):
                with contextlib.suppress(OSError):
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                    unblocked.append(path)

    async def main():
        c = connector(shm_root)
        await c.put("r/e/0", {"codes": []})
        os.mkfifo(index_path(c, "r/e/1"), 0o600)
        guard = threading.Thread(target=watchdog, args=(os.path.dirname(index_path(c, "r/e/1")),))
        guard.start()
        try:
            with pytest.raises(RefusedPayload, match="not a regular file"):
                await c.get("r/e/1", 1)
        finally:
            stop.set()
            guard.join()
    run(main())
    assert not unblocked


def test_unsupported_payloads_are_refused_at_put_and_publish_nothing(shm_root):
    async def main():
        c = connector(shm_root)
        with pytest.raises(UnsupportedPayload, match="cannot carry builtins.object"):
            await c.put("r/e/0", {"x": torch.ones(2), "o": object()})
        assert not os.path.exists(index_path(c, "r/e/0")) and c.stats()["busy_segments"] == 0
    run(main())


def test_request_and_edge_names_cannot_leave_the_keys_directory(shm_root):
    c = connector(shm_root)
    keys = str(tree_path(shm_root) / "keys") + "/"
    for key in ("../e/0", "r/../0", "./e/1", "../../pools/x/seg.1", "..", "a/b"):
        path = os.path.normpath(index_path(c, key))
        assert path.startswith(keys) and path.count("/") == keys.count("/") + (2 if shm.split_key(key) else 1)
