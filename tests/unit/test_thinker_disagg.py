"""Thinker prefill/decode disaggregation: prefill -> connector -> decode returns exactly the aggregated thinker's outputs.

No Ray: the real stage runners (``ThinkerRunner``, ``ThinkerPrefillRunner``, ``ThinkerDecodeRunner``) on real
AR engines, with every edge on one in-process shared-memory connector (the prompt hand-off and the
thinker -> talker stream travel through it encoded, as between replicas). Requests are the calls the
frontend sends; media embeddings come from the encoder on the ``encoder_thinker`` edge.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_serve.checkpoints.qwen2_5_omni import TOKEN_ID
from omni_serve.families.qwen2_5_omni import FAMILY
from omni_serve.families.qwen2_5_omni.messages import (
    MediaEmbeddings, MediaLayout, PrefillDone, SamplingSettings, TalkerPrompt, TextDelta, ThinkerCall,
)
from omni_serve.graph.runner import StageIO, build_runner
from omni_serve.models.qwen2_5_omni import OmniEncoder
from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor
from omni_serve.transport.base import chunk_key, read_chunks
from omni_serve.transport.shm import SharedMemoryConnector
from tests.omni_cases import CASES, template_messages

EOS = TOKEN_ID["<|im_end|>"]
VOICE = TOKEN_ID["<|spk_chelsie|>"]
TIMEOUT = 30.0
EDGE_ENCODER_THINKER, EDGE_PREFILL_DECODE, EDGE_THINKER_TALKER = (
    "encoder_thinker", "thinker_prefill_thinker_decode", "thinker_talker")


@pytest.fixture(scope="module")
def inputs(omni_tiny_dir):
    proc, enc = OmniInputProcessor(omni_tiny_dir), OmniEncoder(omni_tiny_dir)
    out = {}
    for kind in CASES:
        x = proc(*template_messages(kind))
        media = {}
        if x.input_features is not None:
            media["audio"] = enc.encode_audio(x.input_features, x.feature_attention_mask)
        if x.pixel_values is not None:
            media["image"] = enc.encode_image(x.pixel_values, x.image_grid_thw)
        out[kind] = (x, media)
    return out


def make_runners(checkpoint: str, ar: dict | None = None, decode_ar: dict | None = None):
    """(aggregated, prefill, decode) runners of one graph spec; ``ar`` applies to every thinker stage."""
    engine = {"ar": ar or {}}
    spec = {"checkpoint": checkpoint, "thinker_layout": "disaggregated",
            "stages": {"thinker": {"engine": engine}, "thinker_prefill": {"engine": engine},
                       "thinker_decode": {"engine": {"ar": {**(ar or {}), **(decode_ar or {})}}}}}
    return tuple(build_runner(FAMILY, stage, spec) for stage in ("thinker", "thinker_prefill", "thinker_decode"))


@pytest.fixture(scope="module")
def runners(omni_tiny_dir):
    return make_runners(omni_tiny_dir)


def request(rid: str, x, *, talker: bool, max_new: int = 10, temperature: float = 0.0, seed: int = 7,
            min_new: int = 0) -> ThinkerCall:
    """The thinker call the frontend sends (``OmniFrontend.prepare``)."""
    return ThinkerCall(
        request_id=rid, input_ids=x.input_ids[0].tolist(), max_new_tokens=max_new,
        sampling=SamplingSettings(temperature=temperature, top_p=0.9 if temperature else 1.0, seed=seed,
                                  min_new_tokens=min_new),
        stop_token_ids=[EOS], stop=[],
        media_layout=MediaLayout.of(x), expects_media=x.has_media,
        talker=TalkerPrompt(voice_token=VOICE, tts_end_token=0, tts_pad_token=1) if talker else None)


def with_id(req: ThinkerCall, rid: str) -> ThinkerCall:
    return req.model_copy(update={"request_id": rid})


def use(conn, *runners_):
    for r in runners_:
        r.io = StageIO(r.graph, r.stage, r.spec, conn)  # every edge on the test's connector
    return conn


async def _collect(runner, engine, req) -> list:
    return [out async for out in runner.handle(engine, req)]


def _fields(chunk) -> dict:
    """A thinker -> talker chunk's fields, its head's (first chunk) flattened in."""
    out = {name: getattr(chunk, name) for name in type(chunk).model_fields if name != "head"}
    if chunk.head is not None:
        out.update({name: getattr(chunk.head, name) for name in type(chunk.head).model_fields})
    return out


async def _thinker_result(conn, outs: list, rid: str, talker: bool) -> dict:
    chunks = [_fields(c) async for c in read_chunks(conn, rid, EDGE_THINKER_TALKER, TIMEOUT)] if talker else []
    deltas = [o for o in outs if isinstance(o, TextDelta)]
    return {"tokens": [t for o in deltas for t in o.token_ids],
            "text": "".join(o.text for o in deltas),
            "finish": [o.finish_reason for o in deltas if o.finish_reason], "chunks": chunks}


async def _put_media(conn, rid, media):
    if media:
        await conn.put(chunk_key(rid, EDGE_ENCODER_THINKER, 0), MediaEmbeddings(**media))


def hold_until_all_ready(engine, n: int) -> None:
    """``engine`` computes nothing until ``n`` requests are in it, each with rows to compute (its hand-off
    arrived): they reach its scheduler in one step whatever the machine's speed, not as they trickle in."""
    has_work, opened = engine.has_work, False

    def gated() -> bool:  # the worker calls it with the engine's condition held
        nonlocal opened
        if not opened:
            slots = list(engine._slots.values())
            opened = len(slots) >= n and all(s.program.ready() for s in slots)
        return opened and has_work()

    engine.has_work = gated


async def run_both(rs, jobs: list[tuple[dict, dict]], conn, concurrent: bool = True, prefill_first: bool = False):
    """Each job (request, media) through the aggregated thinker and through prefill -> decode (all at once, or
    one after the other; ``prefill_first``: every prefill ends before any decode call opens, so all hand-offs
    reach decode together) -> (aggregated results, disaggregated results, engine stats)."""
    agg, pre, dec = rs
    engines = {"aggregated": agg.make_engine(), "prefill": pre.make_engine(), "decode": dec.make_engine()}
    talker = [req.talker is not None for req, _ in jobs]

    async def aggregated(i, req, media):
        rid = f"agg-{i}"
        await _put_media(conn, rid, media)
        outs = await _collect(agg, engines["aggregated"], with_id(req, rid))
        return await _thinker_result(conn, outs, rid, talker[i])

    async def disaggregated(i, req, media):
        rid = f"dis-{i}"
        await _put_media(conn, rid, media)
        req = with_id(req, rid)
        # as the frontend does: both calls opened at once with the same metadata
        pre_outs, dec_outs = await asyncio.gather(_collect(pre, engines["prefill"], req),
                                                  _collect(dec, engines["decode"], req))
        assert pre_outs == [PrefillDone(prompt_tokens=len(req.input_ids))]
        return await _thinker_result(conn, dec_outs, rid, talker[i])

    async def prefill_then_decode():
        reqs = [with_id(req, f"dis-{i}") for i, (req, _) in enumerate(jobs)]
        for req, (_, media) in zip(reqs, jobs):
            await _put_media(conn, req.request_id, media)
        await asyncio.gather(*(_collect(pre, engines["prefill"], r) for r in reqs))
        hold_until_all_ready(engines["decode"], len(reqs))
        outs = await asyncio.gather(*(_collect(dec, engines["decode"], r) for r in reqs))
        return [await _thinker_result(conn, o, r.request_id, talker[i]) for i, (o, r) in enumerate(zip(outs, reqs))]

    async def each(fn):
        if concurrent:
            return await asyncio.gather(*(fn(i, r, m) for i, (r, m) in enumerate(jobs)))
        return [await fn(i, r, m) for i, (r, m) in enumerate(jobs)]

    try:
        a = await each(aggregated)
        d = await prefill_then_decode() if prefill_first else await each(disaggregated)
        stats = {name: e.stats() for name, e in engines.items()}
    finally:
        for e in engines.values():
            await e.cleanup()
    for s in stats.values():  # every block came back
        assert s["kv_blocks_used"] == 0 and s["active"] == 0, stats
    return a, d, stats


def assert_same(a: dict, d: dict, atol: float = 0.0) -> None:
    assert d["tokens"] == a["tokens"] and len(a["tokens"]) > 0
    assert d["text"] == a["text"] and d["finish"] == a["finish"]
    assert len(d["chunks"]) == len(a["chunks"])
    for ca, cd in zip(a["chunks"], d["chunks"]):
        assert ca.keys() == cd.keys()
        for key, va in ca.items():
            vd = cd[key]
            if isinstance(va, torch.Tensor):
                assert va.shape == vd.shape and va.dtype == vd.dtype, key
                torch.testing.assert_close(vd, va, rtol=0, atol=atol, msg=key)
            else:
                assert vd == va, key


# Alone, a request's tensors are bit for bit those of the aggregated thinker. Batched with others, float32
# rounding depends on the batch's composition (aggregated batching alone moves states by ~1e-6 too):
# tokens stay identical, states are compared to that rounding.
BATCH_ROUNDING = 1e-5


def run_case(rs, jobs, tmp_path, atol=0.0, concurrent=True, prefill_first=False):
    async def main():
        conn = use(SharedMemoryConnector(root=tmp_path, directory=None), *rs)
        return await run_both(rs, jobs, conn, concurrent, prefill_first)

    a, d, stats = asyncio.run(main())
    for ra, rd in zip(a, d):
        assert_same(ra, rd, atol)
    return a, d, stats


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("talker", [False, True], ids=["text", "talker"])
def test_disaggregated_equals_aggregated(runners, inputs, tmp_path, kind, talker):
    """Greedy, one request: tokens, text and every thinker -> talker chunk (tensors bit for bit) match."""
    x, media = inputs[kind]
    a, d, stats = run_case(runners, [(request("r", x, talker=talker), media)], tmp_path)
    # decode computed only the generated tokens' rows; the prompt came as KV from prefill
    prompt = x.input_ids.shape[1]
    assert stats["prefill"]["batched_rows"] == prompt
    assert stats["decode"]["batched_rows"] == len(d[0]["tokens"]) - 1
    assert stats["aggregated"]["batched_rows"] == prompt + len(a[0]["tokens"]) - 1
    if talker:
        first = d[0]["chunks"][0]
        assert first["prompt"].shape[0] == prompt and {"bos", "eos", "pad", "first_token"} <= first.keys()


def test_sampled_with_seed_equals_aggregated(runners, inputs, tmp_path):
    """Sampling (temperature, top-p, seeded) happens once, in decode, from the prefill's logits."""
    jobs = [(request(f"s{i}", inputs[kind][0], talker=i % 2 == 0, temperature=0.9, seed=100 + i, max_new=12,
                     min_new=4), inputs[kind][1])
            for i, kind in enumerate(CASES)]
    a, _, _ = run_case(runners, jobs, tmp_path, concurrent=False)
    assert len({tuple(r["tokens"]) for r in a}) == len(jobs)  # really sampled: different seeds differ


def test_concurrent_requests_equal_aggregated(runners, inputs, tmp_path):
    """Six requests in flight (mixed media, with and without talker): each matches its aggregated run."""
    jobs = [(request(f"c{i}", inputs[CASES[i % 3]][0], talker=i % 2 == 1, max_new=8 + i), inputs[CASES[i % 3]][1])
            for i in range(6)]
    _, _, stats = run_case(runners, jobs, tmp_path, atol=BATCH_ROUNDING)
    assert stats["decode"]["batched_rows"] > stats["decode"]["steps"], "decode never batched requests"


def test_preempted_decode_recomputes_and_still_matches(omni_tiny_dir, inputs, tmp_path):
    """A decode cache too small for the requests in flight: imported KV is dropped on preemption and the
    prompt recomputed from the handed-off embeddings; tokens are identical, states equal to batch rounding."""
    rs = make_runners(omni_tiny_dir, ar={"block_size": 4, "max_batch_tokens": 512},
                      decode_ar={"num_kv_blocks": 28})
    jobs = [(request(f"p{i}", inputs[CASES[i % 3]][0], talker=i % 2 == 0, max_new=16, min_new=16),
             inputs[CASES[i % 3]][1]) for i in range(6)]
    longest = max(len(r.input_ids) for r, _ in jobs) + 16
    assert 28 * 4 >= longest and 6 * longest > 28 * 4  # each fits alone; together they cannot
    # every prefill ends before decode opens its calls, and decode computes nothing until all six hand-offs
    # are in: they reach its scheduler together (not timing)
    _, _, stats = run_case(rs, jobs, tmp_path, atol=BATCH_ROUNDING, prefill_first=True)
    assert stats["decode"]["preemptions"] > 0
    assert stats["decode"]["kv_blocks_free"] == 28


def test_prefix_cache_on_prefill_keeps_outputs(omni_tiny_dir, inputs, tmp_path):
    """Prefill shares cached prompt prefixes (text-only, no talker) and still hands off the right KV."""
    rs = make_runners(omni_tiny_dir, ar={"block_size": 4})
    x, _ = inputs["text"]
    req = request("x", x, talker=False, max_new=6)
    (reference,), _, _ = run_case(rs, [(req, {})], tmp_path / "ref")

    async def sequential():
        use(SharedMemoryConnector(root=tmp_path, directory=None), *rs)
        pre, dec = rs[1].make_engine(), rs[2].make_engine()
        try:
            results = []
            for i in range(2):  # one after the other: the second finds the first's prompt blocks
                r = with_id(req, f"seq-{i}")
                _, outs = await asyncio.gather(_collect(rs[1], pre, r), _collect(rs[2], dec, r))
                results.append([t for o in outs if isinstance(o, TextDelta) for t in o.token_ids])
            return results, pre.stats()
        finally:
            await pre.cleanup()
            await dec.cleanup()

    (first, second), prefill = asyncio.run(sequential())
    assert first == second == reference["tokens"]
    assert prefill["prefix_hit_tokens"] > 0 and prefill["kv_blocks_used"] == 0


def test_mismatched_handoff_fails_the_request_clearly(runners, inputs, tmp_path):
    """A hand-off for another prompt (or another model) fails the decode request with a clear error."""
    x, _ = inputs["text"]
    _, pre, dec = runners

    async def main():
        conn = use(SharedMemoryConnector(root=tmp_path, directory=None), pre, dec)
        pe, de = pre.make_engine(), dec.make_engine()
        try:
            req = request("m", x, talker=False)
            await _collect(pre, pe, req)
            handoff = await conn.get(chunk_key("m", EDGE_PREFILL_DECODE, 0), TIMEOUT)
            bad = handoff.model_copy(update={"k": handoff.k[:1], "v": handoff.v[:1]})  # one layer only
            await conn.put(chunk_key("m2", EDGE_PREFILL_DECODE, 0), bad)
            with pytest.raises(ValueError, match="imported KV has shape"):
                await _collect(dec, de, with_id(req, "m2"))
            short = handoff.model_copy(update={"embeds": handoff.embeds[:-1]})
            await conn.put(chunk_key("m3", EDGE_PREFILL_DECODE, 0), short)
            with pytest.raises(ValueError, match="prompt hand-off"):
                await _collect(dec, de, with_id(req, "m3"))
            assert de.stats()["kv_blocks_used"] == 0
        finally:
            await pe.cleanup()
            await de.cleanup()

    asyncio.run(main())
