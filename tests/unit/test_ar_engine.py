"""AR engine pieces: block allocator, prefix sharing, chunked prefill, abort, refusal, worker failure."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_serve.checkpoints.qwen2_5_omni import TOKEN_ID
from omni_serve.engines.ar import ARConfig, AREngine
from omni_serve.engines.ar.kv_cache import BlockAllocator, block_hashes
from omni_serve.engines.sampling import SamplingParams
from omni_serve.engines.stepper import StepEngine
from omni_serve.engines.base import StageProgram
from omni_serve.families.qwen2_5_omni.replica.programs import ThinkerRequest, ThinkerSequence
from omni_serve.models.qwen2_5_omni import OmniThinker
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from tests.omni_cases import template_messages

EOS = TOKEN_ID["<|im_end|>"]


def test_allocator_is_all_or_nothing_and_counts():
    a = BlockAllocator(num_blocks=4, block_size=4)
    assert a.allocate("x", 9) and a.num_used_blocks == 3
    assert not a.allocate("y", 8) and a.num_used_blocks == 3 and not a.holds("y")
    assert a.allocate("y", 4) and a.num_free_blocks == 0
    a.free("x")
    a.free("y")
    assert a.num_used_blocks == 0 and a.num_free_blocks == 4
    assert a.allocate("z", 6)
    assert a.slots("z", 0, 6).tolist() == [b * 4 + i for b in a.table("z") for i in range(4)][:6]


def test_prefix_blocks_are_shared_and_survive_until_reused():
    a = BlockAllocator(num_blocks=6, block_size=2)
    hashes = block_hashes([1, 2, 3, 4, 5], 2)
    assert len(hashes) == 2
    a.allocate("first", 5)
    for i, h in enumerate(hashes):
        a.register("first", i, h)
    assert a.match_prefix("second", hashes) == 4  # shared while both live
    assert a.num_used_blocks == 3
    a.free("first")
    a.free("second")
    assert a.match_prefix("third", hashes) == 4  # cached after both ended
    a.free("third")
    assert a.allocate("big", 12)  # reuse evicts the cached content
    a.free("big")
    assert a.match_prefix("fourth", hashes) == 0
    assert block_hashes([9, 2, 3, 4], 2)[1] != hashes[1]  # chained: a different first block changes all


@pytest.fixture(scope="module")
def thinker(omni_tiny_dir):
    return OmniThinker(omni_tiny_dir), OmniInputProcessor(omni_tiny_dir)


def sequence(thinker, max_new=12, min_new=0, block_size=16, prompt="text"):
    model, proc = thinker
    ids = proc(*template_messages(prompt)).input_ids[0].tolist()
    return ThinkerSequence(model, proc.tokenizer, ThinkerRequest(
        input_ids=ids, max_new_tokens=max_new, stop_token_ids=(EOS,), block_size=block_size,
        sampling=SamplingParams(temperature=0, min_new_tokens=min_new, stop_token_ids=(EOS,))))


async def collect(engine, rid, seq):
    return [t for out in [o async for o in engine.generate(rid, seq)] for t in out.token_ids]


def test_prefix_cache_hit_gives_identical_tokens(thinker):
    async def main():
        engine = AREngine("thinker", thinker[0], ARConfig(block_size=4))
        try:
            first = await collect(engine, "a", sequence(thinker, block_size=4))
            hits = engine.stats()["prefix_hit_tokens"]
            second = await collect(engine, "b", sequence(thinker, block_size=4))
            return first, second, hits, engine.stats()
        finally:
            await engine.cleanup()
    first, second, hits_before, stats = asyncio.run(main())
    assert hits_before == 0 and stats["prefix_hit_tokens"] > 0
    assert first == second
    assert stats["kv_blocks_used"] == 0


def test_chunked_prefill_matches_one_shot(thinker):
    async def run(cfg):
        engine = AREngine("thinker", thinker[0], cfg)
        try:
            return await asyncio.gather(*(collect(engine, f"r{i}", sequence(thinker)) for i in range(3)))
        finally:
            await engine.cleanup()
    one_shot = asyncio.run(run(ARConfig(enable_prefix_caching=False)))
    chunked = asyncio.run(run(ARConfig(max_batch_tokens=5, enable_prefix_caching=False)))
    assert chunked == one_shot


def test_abort_mid_stream_frees_blocks_at_once(thinker):
    async def main():
        engine = AREngine("thinker", thinker[0], ARConfig(block_size=4))
        try:
            gen = engine.generate("long", sequence(thinker, max_new=400, min_new=400, block_size=4))
            await gen.__anext__()
            await gen.__anext__()
            busy = engine.stats()["kv_blocks_used"]
            await gen.aclose()  # the consumer goes away (client disconnect)
            for _ in range(200):
                if engine.stats()["kv_blocks_used"] == 0:
                    break
                await asyncio.sleep(0.01)
            return busy, engine.stats()
        finally:
            await engine.cleanup()
    busy, after = asyncio.run(main())
    assert busy > 0
    assert after["kv_blocks_used"] == 0 and after["active"] == 0 and after["running"] == 0


def test_request_larger_than_cache_is_refused_clearly(thinker):
    async def main():
        engine = AREngine("thinker", thinker[0], ARConfig(num_kv_blocks=4, block_size=4))
        try:
            await collect(engine, "huge", sequence(thinker, max_new=64))
        finally:
            await engine.cleanup()
    with pytest.raises(ValueError, match="needs .* KV blocks"):
        asyncio.run(main())


def test_min_tokens_suppresses_stop(thinker):
    async def main():
        engine = AREngine("thinker", thinker[0])
        try:
            return await collect(engine, "m", sequence(thinker, max_new=30, min_new=30))
        finally:
            await engine.cleanup()
    tokens = asyncio.run(main())
    assert len(tokens) == 30 and EOS not in tokens


class _Boom(StageProgram):
    def ready(self):
        return True

    def step(self):
        raise RuntimeError("boom")


def test_a_failing_program_fails_only_its_request():
    async def main():
        engine = StepEngine("x")
        try:
            with pytest.raises(RuntimeError, match="boom"):
                async for _ in engine.generate("a", _Boom()):
                    pass
            return engine.alive
        finally:
            await engine.cleanup()
    assert asyncio.run(main())


class _Chunk:
    """Stands in for an upstream payload: zero-copy views into connector memory, returned when it dies."""


class _FailsOnChunk(StageProgram):
    def __init__(self):
        self.got = []

    def feed(self, item):
        self.got.append(item)

    def ready(self):
        return bool(self.got)

    def step(self):
        raise RuntimeError("boom")


def test_a_failed_request_frees_its_program_and_chunks_without_the_garbage_collector():
    """A request failing while its upstream is still open: its program and the chunks it was fed must die
    by reference counting as soon as it ends, even while the caller keeps the error (Serve does). Before,
    the pump task kept going, and the error's traceback and the cancelled pump formed reference cycles
    that held the chunks until a full collection, minutes later in a busy replica."""
    import gc
    import weakref

    refs = {}

    async def upstream():
        chunk = _Chunk()
        refs["chunk"] = weakref.ref(chunk)
        yield chunk
        del chunk
        await asyncio.sleep(3600)  # the producer keeps the stream open

    async def one(engine) -> BaseException | None:
        program = _FailsOnChunk()
        refs["program"] = weakref.ref(program)
        outputs = engine.generate("a", program, upstream())
        del program
        try:
            async for _ in outputs:
                pass
        except RuntimeError as exc:
            return exc
        return None

    async def main():
        engine = StepEngine("x")
        try:
            error = await one(engine)
            for _ in range(500):  # the worker thread returns from the failed step; the pump unwinds
                if all(ref() is None for ref in refs.values()):
                    break
                await asyncio.sleep(0.01)
            return {name: ref() is None for name, ref in refs.items()}, error
        finally:
            await engine.cleanup()

    gc.disable()
    try:
        freed, kept_error = asyncio.run(main())
    finally:
        gc.enable()
    assert isinstance(kept_error, RuntimeError) and "boom" in str(kept_error)
    assert freed == {"program": True, "chunk": True}, freed


def test_paged_attention_needs_the_engine():
    from omni_serve.engines.ar.attention import paged_attention

    class M:
        layer_idx = 0
    with pytest.raises(RuntimeError, match="omni_batch"):
        paged_attention(M(), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), None)


def test_upstream_failure_fails_the_request_and_frees_its_blocks(omni_tiny_dir):
    """The talker's upstream (thinker chunks) breaks mid-request: the caller gets the error, blocks come back."""
    from omni_serve.families.qwen2_5_omni.messages import TalkerHead, ThinkerStates
    from omni_serve.families.qwen2_5_omni.replica.programs import TalkerRequest, TalkerSequence
    from omni_serve.models.qwen2_5_omni import OmniTalker

    talker = OmniTalker(omni_tiny_dir)
    hidden = talker.embedding_size

    async def upstream():
        yield ThinkerStates(states=torch.randn(4, hidden), head=TalkerHead(
            prompt=torch.randn(6, hidden), bos=torch.randn(hidden), eos=torch.randn(hidden),
            pad=torch.randn(hidden), first_token=1))
        await asyncio.sleep(0.2)
        raise ConnectionError("thinker went away")

    async def main():
        engine = AREngine("talker", talker, ARConfig(block_size=4))
        seq = TalkerSequence(talker, TalkerRequest(max_new_tokens=50, sampling=SamplingParams(temperature=0)))
        try:
            with pytest.raises(ConnectionError, match="thinker went away"):
                async for _ in engine.generate("t", seq, upstream()):
                    pass
            for _ in range(200):
                if engine.stats()["kv_blocks_used"] == 0 and engine.stats()["running"] == 0:
                    break
                await asyncio.sleep(0.01)
            return engine.stats()
        finally:
            await engine.cleanup()
    stats = asyncio.run(main())
    assert stats["kv_blocks_used"] == 0 and stats["running"] == 0 and stats["active"] == 0


def test_a_sequence_failing_on_its_inputs_fails_alone_and_the_engine_keeps_serving(thinker):
    """A request whose upstream inputs are invalid (``poll`` raises, e.g. a talker fed one thinker token)
    fails with its own error; requests batched with it finish, and the engine serves the next ones."""
    class BadInputs(type(sequence(thinker))):
        def poll(self):
            raise ValueError("bad upstream input")

    async def main():
        engine = AREngine("thinker", thinker[0])
        try:
            good = asyncio.create_task(collect(engine, "good", sequence(thinker, max_new=8)))
            bad = sequence(thinker, max_new=8)
            bad.__class__ = BadInputs
            with pytest.raises(ValueError, match="bad upstream input"):
                await collect(engine, "bad", bad)
            first = await good
            after = await collect(engine, "after", sequence(thinker, max_new=8))
            return first, after, engine.alive
        finally:
            await engine.cleanup()
    first, after, alive = asyncio.run(main())
    assert alive and first == after and len(first) > 0


@pytest.mark.parametrize("temperature", [3.6e-277, 1e-30, 1e-6])
def test_a_vanishing_temperature_samples_greedily_instead_of_nan(temperature):
    """logits / 1e-277 overflow to inf (softmax NaN, multinomial raises): such temperatures are greedy."""
    from omni_serve.engines.sampling import Sampler

    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=1e-4, seed=1))
    assert sampler.params.greedy and [sampler.select(logits, []) for _ in range(3)] == [1, 1, 1]
    assert Sampler(SamplingParams(temperature=1e-4, seed=1)).select(logits, []) == 1  # sampled, finite
