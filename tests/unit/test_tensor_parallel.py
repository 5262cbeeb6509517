"""Tensor-parallel decoder layers (``PreparedDecoder.shard``) on two gloo ranks in two processes, against one process:
the Qwen2.5-Omni thinker's prepared layers over the paged KV cache (a prompt prefilled in chunks, then decode steps
of two requests: ``tests/unit/test_prepared_decoder.py``'s plan), each rank caching only its KV heads. The tiny
thinker has 2 heads and 1 KV head (each rank keeps its q head and the shared KV head); a variant written here has 4
and 2 (KV heads split). Hidden states equal one process to float rounding and the greedy tokens of every step are the
same; ranks that both keep the first share (a wrong split) fail the comparison (the negative control)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.unit.test_parallel import spawn_ranks
from tests.unit.test_prepared_decoder import _steps

TOL = dict(rtol=0, atol=2e-5)  # the same sums in another order


def _embeds(adapter) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    if hasattr(adapter, "row_size"):  # the thinker
        return {"a": torch.randn(12, adapter.row_size), "b": torch.randn(9, adapter.row_size)}
    width = adapter.model.thinker_to_talker_proj.in_features  # the talker: its decoder reads projected rows
    with torch.inference_mode():
        return {k: adapter.model.thinker_to_talker_proj(torch.randn(n, width)) for k, n in (("a", 12), ("b", 9))}


def _hidden(adapter) -> list[torch.Tensor]:
    with torch.inference_mode():
        return _steps(adapter, _embeds(adapter))


def _greedy(adapter, hidden: list[torch.Tensor]) -> list[list[int]]:
    with torch.inference_mode():
        head = adapter.lm_head if hasattr(adapter, "lm_head") else adapter.model.codec_head
        return [head(h).argmax(-1).tolist() for h in hidden]


def _adapter(checkpoint: str, stage: str):
    from omni_serve.models.qwen2_5_omni import OmniTalker, OmniThinker

    return (OmniThinker if stage == "thinker" else OmniTalker)(checkpoint)


def _rank(rank: int, port: int, checkpoint: str, wrong: bool, stage: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        adapter = _adapter(checkpoint, stage)
        adapter.shard(0 if wrong else rank, 2)
        hidden = _hidden(adapter)
        # numpy arrays travel by value: a tensor would travel as a file descriptor this process shares, which is
        # gone if it exits before the parent reads the queue
        queue.put((rank, (adapter.num_kv_heads, [h.numpy().copy() for h in hidden])))
    finally:
        dist.destroy_process_group()


def on_two_ranks(checkpoint: str, wrong: bool = False, stage: str = "thinker") -> dict[int, tuple]:
    return {rank: (kv, [torch.from_numpy(h) for h in hidden])
            for rank, (kv, hidden) in spawn_ranks(_rank, checkpoint, wrong, stage).items()}


@pytest.fixture(scope="module")
def split_heads_dir(tmp_path_factory) -> str:
    """A tiny Qwen2.5-Omni checkpoint with 4 heads and 2 KV heads (the shipped tiny one has 2 and 1)."""
    import dataclasses

    from omni_serve.checkpoints import qwen2_5_omni as writer

    out = str(tmp_path_factory.mktemp("omni_4_heads"))
    tiny = writer.SIZES["tiny"]
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setitem(writer.SIZES, "tiny", dataclasses.replace(tiny, heads=4, kv_heads=2, mrope=(2, 3, 3)))
        return writer.make_checkpoint(out, "tiny")


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_two_tensor_parallel_ranks_equal_one(omni_tiny_dir, split_heads_dir, stage):
    for checkpoint in (omni_tiny_dir, split_heads_dir):
        one = _adapter(checkpoint, stage)
        kv_heads = one.num_kv_heads
        want = _hidden(one)
        ranks = on_two_ranks(checkpoint, stage=stage)
        tokens = _greedy(one, want)
        for rank, (kv, got) in ranks.items():
            assert kv == (kv_heads // 2 if kv_heads % 2 == 0 else 1)
            err = max(float((g - w).abs().max()) for g, w in zip(got, want))
            print(f"{stage} {os.path.basename(checkpoint)} rank {rank}: {kv} of {kv_heads} KV heads, "
                  f"max |diff| {err:.1e}")
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, **TOL)
            assert _greedy(one, got) == tokens


def test_a_wrong_split_fails_the_comparison(omni_tiny_dir):
    from omni_serve.models.qwen2_5_omni import OmniThinker

    want = _hidden(OmniThinker(omni_tiny_dir))
    got = on_two_ranks(omni_tiny_dir, wrong=True)[1][1]
    err = max(float((g - w).abs().max()) for g, w in zip(got, want))
    print(f"both ranks on the first share: max |diff| {err:.1e}")
    assert err > 50 * TOL["atol"]


def test_shard_refuses_splits_the_heads_do_not_allow(omni_tiny_dir):
    from omni_serve.models.qwen2_5_omni import OmniThinker

    adapter = OmniThinker(omni_tiny_dir)  # 2 heads
    with pytest.raises(ValueError, match="must divide the 2 attention heads"):
        adapter.shard(0, 4)
    assert adapter.prepared.layers[0].heads == 2 and adapter.num_kv_heads == 1  # refused before any change
