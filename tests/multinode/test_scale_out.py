"""The Qwen2.5-Omni graph across a real three-node cluster (``tests/multinode/conftest.py``): encoder and thinker on
one node, talker and code2wav on another, the ingress on the head. Served equal to transformers; every stage
reports the node it runs on; cross-node streams go over Mooncake between the two nodes' IPs and same-node ones over
shared memory; a power-off of the speech node mid-stream ends the request with a clear error within 15 s and the
surviving stages drop it, the graph says it cannot serve (503 at once, /health not ok) and serves again once a
replacement node joins, and what the surviving stages had put for the lost ones is freed once the data directory
(lost with that node) is back; nothing of the finished requests stays in any node's /dev/shm or in the data
directory."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest

from tests.integration.conftest import ORACLE, ORACLE_CODE2WAV
from tests.integration.test_omni_graph import check_against_reference, oracle_request, reference  # noqa: F401
from tests.multinode.conftest import NODE_ENV, start_cluster, stop_cluster, wait_until

pytestmark = pytest.mark.multinode

AR, SPEECH, INGRESS = "omni_ar", "omni_speech", "omni_ingress"
PLACEMENT = {"encoder": "worker1", "thinker": "worker1", "talker": "worker2", "code2wav": "worker2"}
LOSS_BOUND_S = 15  # a request hit by a node's loss ends within this (issue 37's acceptance)
RECOVERY_BOUND_S = 60  # the graph serves again this soon after a replacement node joined
PAYLOAD_TTL_S = float(NODE_ENV["OMNI_SERVE_DATA_TTL_S"])


DIRECTORY_ON_SPEECH_NODES = """
from omni_serve.transport.directory import DIRECTORY_NAME, DataDirectory
d = DataDirectory.options(name=DIRECTORY_NAME, namespace="omni_serve", lifetime="detached", get_if_exists=True,
                          resources={{"{resource}": 0.01}}).remote(20.0)
print(ray.get(d.where.remote())["node_ip"])
"""


def surviving_stages_hold_nothing(http, lost: set[str], data_plane: bool = True) -> bool:
    """No stage outside ``lost`` holds a request in its engine or (``data_plane``) a payload in its connectors."""
    info = http.get("/health?fresh=1").json()["stages"]
    for stage, s in info.items():
        if stage in lost or "error" in s:
            continue
        held = {c: v for c, v in s["data_plane"].items() if v.get("regions") or v.get("busy_segments")
                or v.get("unread")} if data_plane else {}
        if s.get("active") or held:
            print(f"{stage} still holds: {s.get('active')} requests, {held}", flush=True)
            return False
    return True


@pytest.fixture(scope="module")
def cluster(omni_tiny_dir):
    c = start_cluster([{INGRESS: 10}, {AR: 10}, {SPEECH: 10}])
    try:
        # The data directory starts on the speech node, the one the power-off test takes away (by default it is
        # on the head), and may only run where the speech stages may: the graph must recover from losing it
        # too, once a replacement speech node joins.
        where = c.python_in("head", DIRECTORY_ON_SPEECH_NODES.format(resource=SPEECH))
        assert where == c.ip("worker2"), where
        resource = {"worker1": AR, "worker2": SPEECH}
        c.deploy("qwen2_5_omni", {
            "checkpoint": os.path.abspath(omni_tiny_dir),  # the drivers run in the nodes' namespaces, cwd /
            "ingress.resources": {INGRESS: 1},
            **{f"stages.{s}.resources": {resource[node]: 1} for s, node in PLACEMENT.items()},
            "stages.talker.params.max_codec_tokens": ORACLE["talker_tokens"],
            **ORACLE_CODE2WAV,
        }, name="omni", route_prefix="/")
        yield c
    finally:
        stop_cluster(c)


def stages(http) -> dict:
    return http.get("/health?fresh=1").json()["stages"]


def test_served_across_nodes_matches_transformers_and_each_stage_runs_where_placed(cluster, http, reference):
    r = http.post("/v1/chat/completions", json=oracle_request("audio"))
    assert r.status_code == 200, r.text
    check_against_reference(r.json(), reference("audio"))
    info = stages(http)
    for stage, node in PLACEMENT.items():
        assert info[stage]["node_ip"] == cluster.ip(node), (stage, info[stage])
    assert len({info[s]["node_id"] for s in PLACEMENT}) == 2


def test_cross_node_streams_go_over_mooncake_and_same_node_ones_over_shared_memory(cluster, http):
    info = stages(http)
    reads = {r["edge"]: r for s in PLACEMENT for r in info[s]["routes"] if r["side"] == "get"}
    expected = {"ingress_encoder": ("head", "worker1"), "encoder_thinker": ("worker1", "worker1"),
                "thinker_talker": ("worker1", "worker2"), "talker_code2wav": ("worker2", "worker2")}
    for edge, (producer, reader) in expected.items():
        route = reads[edge]
        assert route["producer"]["ip"] == cluster.ip(producer) and route["reader"]["ip"] == cluster.ip(reader), route
        assert route["backend"] == ("shm" if producer == reader else "mooncake"), route


def _stream(url: str, body: dict, out: dict) -> None:
    """A streaming chat request: records when the first event came, every line, and when the stream ended."""
    out["lines"] = []
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    out.setdefault("first", time.monotonic())
                    out["lines"].append(line)
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)
    out["end"] = time.monotonic()


def test_power_off_mid_stream_ends_the_request_and_a_replacement_node_serves_again(cluster, http, reference):
    _ends_with_an_error_within_the_bound(cluster, lambda: cluster.power_off("worker2"))

    # the surviving stages dropped the request from their engines. What the thinker had put for the talker stays
    # until the data directory (which died with worker2) is back: freeing a payload whose directory entry may
    # still be claimed would let a late reader's read mark land in reused memory. Checked after the recovery.
    wait_until(lambda: surviving_stages_hold_nothing(http, {"talker", "code2wav"}, data_plane=False), LOSS_BOUND_S,
               0.5, "the surviving stages dropping the request")
    # nowhere to re-place talker and code2wav: /health says so, requests get a fast 503
    wait_until(lambda: http.get("/health").status_code == 503, LOSS_BOUND_S, what="/health turning 503")
    t0 = time.monotonic()
    r = http.post("/v1/chat/completions", json=oracle_request("text"))
    assert r.status_code == 503 and "Retry-After" in r.headers, r.text
    assert time.monotonic() - t0 <= LOSS_BOUND_S
    # a replacement machine for the speech stages joins: the graph serves again
    cluster.join("worker3", {SPEECH: 10})
    joined = time.monotonic()

    def served():
        r = http.post("/v1/chat/completions", json=oracle_request("text"), timeout=RECOVERY_BOUND_S)
        return r if r.status_code == 200 else None

    r = wait_until(served, RECOVERY_BOUND_S, 1.0, "a request served after the replacement joined")
    print(f"served again {time.monotonic() - joined:.1f} s after the replacement node joined")
    check_against_reference(r.json(), reference("text"))
    info = stages(http)
    assert info["talker"]["node_ip"] == info["code2wav"]["node_ip"] == cluster.ip("worker3")
    # the directory died with worker2 and Ray restarted it on the replacement
    where = cluster.python_in("head", "from omni_serve.transport.directory import directory\nimport asyncio\n"
                              "print(asyncio.run(directory().call('where'))['node_ip'])")
    assert where == cluster.ip("worker3"), where
    # the directory came back empty: the payloads put for the lost talker are the thinker's to free, within two
    # payload TTLs of their put (its sweep: no entry left to claim them)
    wait_until(lambda: surviving_stages_hold_nothing(http, set()), 2 * PAYLOAD_TTL_S + 30, 2.0,
               "every stage freeing what it held for the lost node's stages")


def _ends_with_an_error_within_the_bound(cluster, cut, http=None, holder: str | None = None) -> None:
    """A long streaming request; once its first event is in, ``cut()`` takes a node away: the stream must end
    with an error event and ``[DONE]`` within ``LOSS_BOUND_S``. With ``holder``, a stage on the node cut: the cut
    waits for a stream that this stage still holds (one whose part there had already ended, e.g. a thinker done
    with its tokens while the talker speaks them on another node, is let finish, and another is sent)."""
    # 1200 tokens: the thinker is still writing when the node goes (with 400 it could finish between the holder
    # check and the cut, leaving the talker to read its last payloads from the node cut off, which is not the case
    # this bound is about)
    body = {**oracle_request("text"), "stream": True, "max_tokens": 1200, "min_tokens": 1200, "temperature": 0.7}
    for _ in range(3):
        out: dict = {}
        client = threading.Thread(target=_stream, args=(cluster.url, body, out))
        client.start()
        wait_until(lambda: "first" in out or "end" in out, 120, 0.05, "the stream's first event")
        assert "first" in out, out
        if holder is None or stages(http)[holder].get("active"):
            break
        client.join(120)
    else:
        raise AssertionError(f"no stream was still held by {holder} after its first event, in 3 tries")
    lost_at = time.monotonic()
    cut()
    client.join(LOSS_BOUND_S + 30)
    assert "end" in out and out["end"] - lost_at <= LOSS_BOUND_S, out.get("end", 0) - lost_at
    print(f"the stream ended {out['end'] - lost_at:.1f} s after the node was lost")
    assert out["status"] == 200 and any('"error"' in line for line in out["lines"]), out["lines"][-3:]
    assert out["lines"][-1] == "data: [DONE]"


def test_a_partitioned_node_ends_its_requests_and_a_replacement_takes_its_stages(cluster, http, reference):
    """The encoder and thinker's node loses its link mid-stream (its processes live on, cut off)."""
    _ends_with_an_error_within_the_bound(cluster, lambda: cluster.partition("worker1"), http, holder="thinker")
    wait_until(lambda: surviving_stages_hold_nothing(http, {"encoder", "thinker"}), LOSS_BOUND_S, 0.5,
               "the surviving stages freeing the request")
    wait_until(lambda: http.get("/health").status_code == 503, LOSS_BOUND_S, what="/health turning 503")
    assert http.post("/v1/chat/completions", json=oracle_request("text")).status_code == 503
    cluster.join("worker4", {AR: 10})
    r = wait_until(lambda: (lambda r: r if r.status_code == 200 else None)(
        http.post("/v1/chat/completions", json=oracle_request("text"))), RECOVERY_BOUND_S, 1.0,
        "a request served after the replacement joined")
    check_against_reference(r.json(), reference("text"))
    info = stages(http)
    assert info["encoder"]["node_ip"] == info["thinker"]["node_ip"] == cluster.ip("worker4")
    # the cluster counted the cut-off node dead: it is gone for good (healing its link would not bring it back)
    cluster.power_off("worker1")


def test_nothing_of_the_finished_requests_stays_on_any_node_or_in_the_directory(cluster, http):
    alive = [n.name for n in cluster.state.nodes if n.pid is not None]
    wait_until(lambda: not cluster.shm_leftovers(alive), 60, 2.0, "every node's /dev/shm emptied")
    wait_until(lambda: cluster.directory_keys() == [], 90, 3.0, "the data directory emptied")
