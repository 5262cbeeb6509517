"""The decode batch's contiguous KV copy (``omni_serve.engines.ar.decode_kv``): attention over it is
bit-identical to gathering the paged cache, step after step, as requests join, leave, skip steps and grow past its
capacity; a request's row is filled from the cache only when it joins (or its KV changed), so a changing batch
costs one row, not a rebuild; and the engine's tokens do not change with it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from omni_serve.engines.ar import ARConfig, AREngine
from omni_serve.engines.ar.attention import PagedBatch, paged_attention
from omni_serve.engines.ar.decode_kv import DecodeKV
from omni_serve.engines.ar.kv_cache import BlockAllocator, PagedKVCache
from tests.omni_cases import CASES
from tests.unit.test_ar_engine import collect, sequence, thinker  # noqa: F401 - the module's fixture

LAYERS, HEADS, KV_HEADS, DIM, BLOCK = 2, 4, 2, 8, 4


def _step(cache, blocks, copy, lengths, new):
    """One decode-only step for ``lengths`` (id -> tokens before it, new token included at ``new``)."""
    segments = []
    for rid, n in lengths.items():
        blocks.allocate(rid, n + 1)
        read = blocks.slots(rid, 0, n + 1)
        segments.append((rid, 1, read[n:], read))
    batch = PagedBatch.build(cache, segments, copy)
    t = len(segments)
    torch.manual_seed(sum(lengths.values()) + 7 * t + new)
    q, k, v = torch.randn(1, HEADS, t, DIM), torch.randn(1, KV_HEADS, t, DIM), torch.randn(1, KV_HEADS, t, DIM)
    outs = [paged_attention(SimpleNamespace(layer_idx=layer), q, k, v, None, omni_batch=batch)[0]
            for layer in range(LAYERS)]
    return torch.stack(outs), batch.decode_kv


def test_attention_over_the_copy_equals_gathering_the_cache_as_the_batch_changes():
    def run(copy):
        cache = PagedKVCache(LAYERS, KV_HEADS, DIM, num_blocks=256, block_size=BLOCK)
        blocks = BlockAllocator(256, BLOCK)
        lengths = {"a": 0, "b": 5}
        outs, modes = [], []
        for step in range(300):  # past the copy's first capacity (128) twice
            if step == 40:
                lengths["c"] = 17  # joins
            if step == 90:
                del lengths["a"]  # leaves
                blocks.free("a")
            out, plan = _step(cache, blocks, copy, lengths, step)
            outs.append(out)
            modes.append(None if plan is None else plan.fill_rows is not None)
            lengths = {rid: n + 1 for rid, n in lengths.items()}
        return outs, modes
    gathered, _ = run(None)
    copy = DecodeKV(LAYERS, KV_HEADS, DIM, torch.float32, "cpu", budget_bytes=2**30)
    copied, modes = run(copy)
    assert all(torch.equal(a, b) for a, b in zip(gathered, copied))
    filled = [i for i, m in enumerate(modes) if m]
    assert filled == [0, 40], filled  # only joins fill rows; "a" leaving moves "c" into its row
    # rows filled: b at step 0, c at 40 ("a" starts empty: its first token is an append); appended: a 90 steps,
    # b 299, c 259
    assert (copy.rebuilds, copy.moves, copy.appends) == (2, 1, 90 + 299 + 259), vars(copy)
    assert copy.reallocations <= 4  # capacity grows in steps, not every step


def test_churning_batch_in_any_order_equals_gathering_the_cache():
    """Continuous batching at high concurrency: every few steps requests join, finish, skip a step (a prefill chunk
    elsewhere) or come back with more KV than the copy saw, and the packed order shuffles."""
    import random

    def run(copy):
        cache = PagedKVCache(LAYERS, KV_HEADS, DIM, num_blocks=1024, block_size=BLOCK)
        blocks = BlockAllocator(1024, BLOCK)
        rng = random.Random(3)
        lengths, outs, born = {}, [], 0
        for step in range(200):
            for rid in [r for r in lengths if rng.random() < 0.04]:  # finishes
                del lengths[rid]
                blocks.free(rid)
            while len(lengths) < 12 and rng.random() < 0.5:  # joins, with a prompt already cached
                lengths[f"r{born}"], born = rng.randrange(1, 60), born + 1
            for rid in lengths:
                if rng.random() < 0.05:  # its KV grew without a decode step (a chunk, a recompute)
                    lengths[rid] += rng.randrange(2, 9)
            step_ids = [r for r in lengths if rng.random() > 0.1]  # the rest skip this step
            rng.shuffle(step_ids)
            if not step_ids:
                continue
            out, _ = _step(cache, blocks, copy, {r: lengths[r] for r in step_ids}, step)
            outs.append(out)
            for rid in step_ids:
                lengths[rid] += 1
        return outs
    gathered = run(None)
    copy = DecodeKV(LAYERS, KV_HEADS, DIM, torch.float32, "cpu", budget_bytes=2**30)
    copied = run(copy)
    assert len(gathered) > 150 and all(torch.equal(a, b) for a, b in zip(gathered, copied))
    assert copy.appends > 3 * copy.rebuilds and copy.moves > 0, vars(copy)


def test_a_copy_over_budget_falls_back_to_gathering():
    copy = DecodeKV(LAYERS, KV_HEADS, DIM, torch.float32, "cpu", budget_bytes=copy_bytes(1, 128) - 1)
    cache = PagedKVCache(LAYERS, KV_HEADS, DIM, num_blocks=64, block_size=BLOCK)
    _, plan = _step(cache, BlockAllocator(64, BLOCK), copy, {"a": 3}, 0)
    assert plan is None


def copy_bytes(rows, tokens):
    return 2 * LAYERS * rows * tokens * KV_HEADS * DIM * 4


def test_engine_tokens_are_the_same_with_and_without_the_copy(thinker):  # noqa: F811 - fixture
    async def run(mib):
        engine = AREngine("thinker", thinker[0], ARConfig(decode_kv_copy_mib=mib, enable_prefix_caching=False))
        try:
            async def late(i):  # staggered joins and different lengths: the batch changes while decoding
                await asyncio.sleep(0.05 * i)
                return await collect(engine, f"r{i}", sequence(thinker, max_new=6 + 5 * i, min_new=6 + 5 * i,
                                                               prompt=CASES[i % len(CASES)]))
            tokens = await asyncio.gather(*(late(i) for i in range(4)))
            return tokens, engine.stats()
        finally:
            await engine.cleanup()
    gathered, off = asyncio.run(run(0))
    copied, on = asyncio.run(run(64))
    assert copied == gathered
    assert off["decode_kv_appends"] == 0 and on["decode_kv_appends"] > 0
