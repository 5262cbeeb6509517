"""The vLLM thinker backend's parts that need neither Ray nor vLLM: the tap's row bookkeeping and extraction,
the prompt and media hand-over, the spec/graph wiring of ``engine.backend``, and the compat module."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omni_serve.engines.vllm_engine import compat
from omni_serve.engines.vllm_engine.tap import TAP_KEY, TapError, TapRows, _publish, external_request_id
from omni_serve.kits.omni.frontend import raw_media
from omni_serve.families.qwen2_5_omni.replica.vllm_thinker import collapse_placeholders, vllm_media


# -- tap ---------------------------------------------------------------------------------------------------
def _rows(start: int, n: int, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.arange(start, start + n, dtype=torch.float32).view(-1, 1).expand(n, dim)
    return idx.clone(), -idx.clone()


def test_tap_rows_hand_out_rows_in_order_and_skip_rows_recomputed_after_preemption():
    async def go():
        rows = TapRows()
        rows.add(0, *_rows(0, 5))
        rows.add(5, *_rows(5, 1))
        rows.add(0, *_rows(0, 7))  # preempted and recomputed from row 0: only row 6 is new
        h, e = await rows.take(6, timeout_s=1)
        assert h[:, 0].tolist() == [0, 1, 2, 3, 4, 5] and torch.equal(e, -h)
        h, _ = await rows.take(1, timeout_s=1)
        assert h[:, 0].tolist() == [6]
        assert rows.count == 7

    asyncio.run(go())


def test_tap_rows_wait_for_rows_and_fail_clearly():
    async def go():
        rows = TapRows()
        waiter = asyncio.create_task(rows.take(3, timeout_s=5))
        await asyncio.sleep(0.01)
        rows.add(0, *_rows(0, 2))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        rows.add(2, *_rows(2, 1))
        h, _ = await waiter
        assert h[:, 0].tolist() == [0, 1, 2]
        with pytest.raises(TapError, match="did not arrive"):
            await rows.take(1, timeout_s=0.05)
        rows.add(9, *_rows(9, 1))  # a gap: rows were lost
        with pytest.raises(TapError, match="skip from 3 to 9"):
            await rows.take(1, timeout_s=1)

    asyncio.run(go())


class _Sock:
    def __init__(self):
        self.sent = []

    def send_multipart(self, frames):
        self.sent.append(frames)


def _runner(req_ids, starts, computed, tapped):
    reqs = {rid: SimpleNamespace(sampling_params=SimpleNamespace(extra_args={TAP_KEY: True} if t else None))
            for rid, t in zip(req_ids, tapped)}
    return SimpleNamespace(
        input_batch=SimpleNamespace(num_reqs=len(req_ids), req_ids=req_ids,
                                    num_computed_tokens_cpu=np.array(computed)),
        query_start_loc=SimpleNamespace(np=np.array(starts)), requests=reqs)


def test_publish_sends_only_tapped_requests_rows_with_their_sequence_index():
    import json

    # a step with three requests: a 4-row prefill chunk (rows 0-3), a decode of an untapped request, a decode
    runner = _runner(["a-1234abcd", "b-1234abcd", "c-x-1234abcd"], [0, 4, 5, 6], [8, 20, 31], [True, False, True])
    hidden = torch.arange(6, dtype=torch.float32).view(-1, 1).repeat(1, 3)
    sock = _Sock()
    _publish(runner, sock, hidden, {"inputs_embeds": hidden * 10, "input_ids": None})
    (header, h, e), = sock.sent
    header = json.loads(header)
    assert header == {"reqs": [["a", 8, 4], ["c-x", 31, 1]], "dim": 3}
    assert np.asarray(h)[:, 0].tolist() == [0, 1, 2, 3, 5]
    assert np.asarray(e)[:, 0].tolist() == [0, 10, 20, 30, 50]
    sock.sent.clear()
    _publish(_runner(["b-1234abcd"], [0, 1], [3], [False]), sock, hidden[:1], {"inputs_embeds": hidden[:1]})
    assert sock.sent == []  # nothing tapped: nothing sent


def test_a_tensor_parallel_rank_other_than_0_joins_the_embedding_lookup_and_sends_nothing():
    """Under tensor parallelism vLLM's embedding lookup is a collective: every rank's tap makes it, rank 0 alone
    (the one with a socket) sends the rows."""
    looked_up = []
    runner = _runner(["a-1234abcd"], [0, 2], [0], [True])
    runner.model = SimpleNamespace(embed_input_ids=lambda ids: looked_up.append(ids.tolist()) or ids[:, None] * 1.0)
    hidden = torch.ones(2, 1)
    _publish(runner, None, hidden, {"inputs_embeds": None, "input_ids": torch.tensor([7, 9])})
    assert looked_up == [[7, 9]]
    sock = _Sock()
    _publish(runner, sock, hidden, {"inputs_embeds": None, "input_ids": torch.tensor([7, 9])})
    assert looked_up == [[7, 9], [7, 9]] and np.asarray(sock.sent[0][2])[:, 0].tolist() == [7, 9]


def test_external_request_id_strips_vllms_suffix():
    assert external_request_id("chatcmpl-abc-1f2e3d4c") == "chatcmpl-abc"


# -- prompt and media --------------------------------------------------------------------------------------
def test_collapse_placeholders_leaves_one_token_per_media_item():
    audio, image = 90, 91
    ids = [1, 5, audio, audio, audio, 6, 5, image, image, 6, 2, image, 3]
    assert collapse_placeholders(ids, (audio, image, 92)) == [1, 5, audio, 6, 5, image, 6, 2, image, 3]


def test_raw_media_round_trips_to_vllms_multimodal_data():
    import PIL.Image

    clips = [np.linspace(-1, 1, 1600, dtype=np.float32), np.zeros(800, dtype=np.float32)]
    rgba = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 255, (5, 7, 4), dtype=np.uint8), "RGBA")
    gray = PIL.Image.fromarray(np.arange(12, dtype=np.uint8).reshape(3, 4), "L")
    data = vllm_media(raw_media(clips, [rgba, gray]))
    assert [len(a) for a, _ in data["audio"]] == [1600, 800] and all(sr == 16000 for _, sr in data["audio"])
    np.testing.assert_array_equal(data["audio"][0][0], clips[0])
    assert [im.size for im in data["image"]] == [(7, 5), (4, 3)]
    np.testing.assert_array_equal(np.asarray(data["image"][0]), np.asarray(rgba.convert("RGB")))
    np.testing.assert_array_equal(np.asarray(data["image"][1]), np.asarray(gray.convert("RGB")))
    assert "image" not in vllm_media(raw_media(clips, []))


# -- spec and graph ----------------------------------------------------------------------------------------
def _spec(**values):
    from omni_serve.families.qwen2_5_omni import FAMILY

    return FAMILY.parse({"checkpoint": "unused", **values})


def test_backend_vllm_selects_the_vllm_layout_without_an_encoder(monkeypatch):
    from omni_serve.engines.vllm_engine.config import VLLM_PYTHON_ENV
    from omni_serve.families.qwen2_5_omni.graph import GRAPH

    monkeypatch.setenv(VLLM_PYTHON_ENV, "/opt/vllm/bin/python")
    spec = _spec(**{"stages.thinker.engine.backend": "vllm"})
    assert spec.layout() == "aggregated_vllm" and spec.thinker_backend() == "vllm"
    assert spec.deployed_stages() == ["thinker", "talker", "code2wav"]
    assert [(link.writer, link.edge) for link in GRAPH.links(spec.layout())][0] == ("ingress", "ingress_thinker")
    opts = spec.stage_spec("thinker").deployment_options("thinker")
    assert opts["ray_actor_options"]["runtime_env"]["py_executable"] == "/opt/vllm/bin/python"
    assert "py_executable" not in spec.stage_spec("talker").deployment_options("talker")["ray_actor_options"].get(
        "runtime_env", {})
    named = _spec(**{"stages.thinker.engine.backend": "vllm", "stages.thinker.engine.vllm.python": "/x/python"})
    assert named.stage_spec("thinker").deployment_options("thinker")["ray_actor_options"]["runtime_env"][
        "py_executable"] == "/x/python"
    assert GRAPH.stage("thinker").runner_for("vllm").endswith("vllm_thinker:VllmThinkerRunner")
    native = _spec()
    assert native.layout() == "aggregated" and "encoder" in native.deployed_stages()
    assert "ingress_thinker" not in [link.edge for link in GRAPH.links("aggregated")]


def test_backend_vllm_is_rejected_where_it_cannot_run():
    with pytest.raises(ValueError, match="needs thinker_layout 'aggregated'"):
        _spec(**{"stages.thinker.engine.backend": "vllm", "thinker_layout": "disaggregated"})
    with pytest.raises(ValueError, match="stage talker has no 'vllm' engine backend"):
        _spec(**{"stages.talker.engine.backend": "vllm"})
    with pytest.raises(ValueError):
        _spec(**{"stages.thinker.engine.backend": "tensorrt"})


# -- compat ------------------------------------------------------------------------------------------------
def test_check_version_says_how_to_install_vllm_when_it_is_missing(monkeypatch):
    from importlib import metadata

    def missing(dist):
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(RuntimeError, match="make vllm-env"):
        compat.check_version()
    monkeypatch.setattr(metadata, "version", lambda dist: "0.99.0")
    with pytest.raises(RuntimeError, match="written for vLLM 0.32.0"):
        compat.check_version()
    monkeypatch.setattr(metadata, "version", lambda dist: "0.32.0+cpu")
    assert compat.check_version() == "0.32.0+cpu"


def test_pth_hook_line_installs_one_hook_and_is_harmless(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    compat.install_pth(str(site))
    code = ("import site, sys; site.addsitedir(sys.argv[1]); "
            "from omni_serve.torchvision_compat import TorchvisionOpsHook as H, install_hook; "
            "install_hook(); install_hook(); "  # idempotent
            "print(sum(isinstance(f, H) for f in sys.meta_path))")
    out = subprocess.run([sys.executable, "-c", code, str(site)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "error"})
    assert out.stdout.strip() == "1" and not out.stderr
    # the vLLM module re-exports the same hook (its environment's .pth is the same file)
    assert compat.TorchvisionOpsHook is __import__("omni_serve.torchvision_compat").torchvision_compat.TorchvisionOpsHook
    assert compat.engine_env(0.4, "nobind") == {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
