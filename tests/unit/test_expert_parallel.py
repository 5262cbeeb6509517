"""Expert parallelism (``omni_serve.parallel.experts``) on two gloo ranks in two processes, against one process: the
Qwen3-Omni thinker and talker (mixtures of experts: 4 experts, top 2, in every layer of the tiny checkpoint; the
talker's shared expert stays whole on every rank) over the paged KV
cache, a prompt prefilled in chunks and then decode steps of two requests (``tests/unit/test_prepared_decoder.py``'s
plan). Each rank keeps 2 of the 4 experts of each layer; the hidden states and logits equal one process to float
rounding and every step's greedy tokens are the same. A rank whose experts compute nothing (its share lost) fails
the comparison (the negative control)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from omni_serve.engines.ar.attention import PagedBatch
from omni_serve.engines.ar.kv_cache import PagedKVCache
from tests.unit.test_parallel import spawn_ranks

TOL = dict(rtol=0, atol=2e-5)  # the same sums in another order


def _adapter(checkpoint: str, stage: str):
    from omni_serve.models.qwen3_omni import Qwen3OmniTalker, Qwen3OmniThinker

    return (Qwen3OmniThinker if stage == "thinker" else Qwen3OmniTalker)(checkpoint)


def _steps(adapter) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Prefill a in chunks of 5 + rest, prefill b, then 3 decode steps of both: (hidden, logits) per step."""
    torch.manual_seed(1)
    if hasattr(adapter, "rows"):  # the thinker: embeddings, deepstack features zero
        embeds = {"a": adapter.rows(torch.randn(12, adapter.hidden_size)),
                  "b": adapter.rows(torch.randn(9, adapter.hidden_size))}
    else:  # the talker: talker-sized rows
        embeds = {"a": torch.randn(12, adapter.embedding_size), "b": torch.randn(9, adapter.embedding_size)}
    cache = PagedKVCache(adapter.num_layers, adapter.num_kv_heads, adapter.head_dim, 16, 4, torch.float32, "cpu")
    slots = {"a": torch.arange(0, 32), "b": torch.arange(32, 64)}
    done = {"a": 0, "b": 0}
    out = []
    for step in [[("a", 5)], [("a", 4), ("b", 6)]] + [[("a", 1), ("b", 1)]] * 3:
        rows, pos, segments = [], [], []
        for rid, n in step:
            s = done[rid]
            rows.append(embeds[rid][s:s + n])
            pos.append(adapter.step_positions(s, 0, n))
            segments.append((rid, n, slots[rid][s:s + n], slots[rid][:s + n]))
            done[rid] += n
        x = torch.cat(rows)
        hidden, logits = adapter.forward_packed(x, torch.cat(pos, dim=1), PagedBatch.build(cache, segments),
                                                torch.arange(x.shape[0]), True)
        out.append((hidden.clone(), logits.clone()))
    return out


def _rank(rank: int, port: int, checkpoint: str, stage: str, lose_share: bool, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        adapter = _adapter(checkpoint, stage)
        adapter.shard_experts(2)
        experts = [m for m in adapter.model.modules() if type(m).__name__.endswith("Experts")]
        local = [m.gate_up_proj.to_local().shape[0] for m in experts]
        if lose_share and rank == 1:
            for m in experts:
                m.down_proj.to_local().zero_()
        # numpy, not tensors: a tensor on the queue is shared through this process, which exits next
        queue.put((rank, (local, [(h.numpy(), g.numpy()) for h, g in _steps(adapter)])))
    finally:
        dist.destroy_process_group()


def _err(got, want) -> float:
    return max(float((torch.as_tensor(g) - w).abs().max()) for gs, ws in zip(got, want) for g, w in zip(gs, ws))


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_two_expert_parallel_ranks_equal_one(qwen3_omni_tiny_dir, stage):
    one = _adapter(qwen3_omni_tiny_dir, stage)
    want = _steps(one)
    for rank, (local, got) in spawn_ranks(_rank, qwen3_omni_tiny_dir, stage, False).items():
        print(f"{stage} rank {rank}: experts per layer {local}, max |diff| {_err(got, want):.1e}")
        assert local == [2] * len(local) and local
        for (gh, gl), (wh, wl) in zip(got, want):
            gh, gl = torch.as_tensor(gh), torch.as_tensor(gl)
            torch.testing.assert_close(gh, wh, **TOL)
            torch.testing.assert_close(gl, wl, **TOL)
            assert gl.argmax(-1).tolist() == wl.argmax(-1).tolist()
    lost = spawn_ranks(_rank, qwen3_omni_tiny_dir, stage, True)[0][1]
    print(f"{stage}, rank 1's experts computing nothing: max |diff| {_err(lost, want):.1e}")
    assert _err(lost, want) > 50 * TOL["atol"]


def test_a_split_the_experts_do_not_allow_is_refused_before_any_change(qwen3_omni_tiny_dir):
    from omni_serve.models.qwen3_omni import Qwen3OmniThinker

    adapter = Qwen3OmniThinker(qwen3_omni_tiny_dir)  # 4 experts per layer
    with pytest.raises(ValueError, match="must divide the 4 experts"):
        adapter.check_expert_shard(3)
    adapter.check_expert_shard(4)
    experts = [m for m in adapter.model.modules() if type(m).__name__.endswith("Experts")]
    assert all(m.num_experts == 4 and m.gate_up_proj.shape[0] == 4 for m in experts)
