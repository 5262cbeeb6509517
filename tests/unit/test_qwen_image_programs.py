"""Oracle tests of the Qwen-Image stages on their real engines, in process (no Ray).

text_encoder -> dit -> vae run as BatchEngines, with queues standing in for the data plane; every image
must match diffusers' ``QwenImagePipeline`` on the same checkpoint and seed, alone and while batched with
other requests at other timesteps, with and without true CFG: its final latents within float rounding and its
pixels within a level (``tests.image_oracle``); the same comparison fails for another request's prompt or seed.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from omni_serve.engines.batch import BatchEngine
from omni_serve.kits.diffusion.messages import DenoiseCall, FinalLatents, PromptEmbeds
from omni_serve.kits.diffusion.replica import programs as P
from omni_serve.models.qwen_image import QwenImageDecoder, QwenImageDenoiser, QwenImageTextEncoder
from tests.image_oracle import LATENT_ATOL, Result, assert_matches, assert_swaps_fail, pipeline_result

SIZE = 64


@pytest.fixture(scope="module")
def parts(qwen_image_tiny_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(qwen_image_tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    return (pipe, QwenImageTextEncoder(qwen_image_tiny_dir), QwenImageDenoiser(qwen_image_tiny_dir),
            QwenImageDecoder(qwen_image_tiny_dir))


def reference(pipe, prompt, negative, seed, steps, cfg, n=1) -> Result:
    return pipeline_result(pipe, seed, prompt=prompt, negative_prompt=negative, true_cfg_scale=cfg, height=SIZE,
                           width=SIZE, num_inference_steps=steps, num_images_per_prompt=n)


class InProcessImage:
    def __init__(self, te, dn, de, max_batch=8, cache_factory=None):
        self.te, self.dn = te, dn
        self.text = BatchEngine("text_encoder", te.encode, max_batch=max_batch)
        self.dit = BatchEngine("dit", P.DenoiseCompute(dn), max_batch=max_batch)
        self.vae = BatchEngine("vae", P.DecodeCompute(de), max_batch=max_batch)
        self.cache_factory = cache_factory
        self.step_log: list[tuple[str, int]] = []

    async def close(self):
        for e in (self.text, self.dit, self.vae):
            await e.cleanup()

    async def run(self, rid, prompt, negative=None, seed=0, steps=4, cfg=1.0, n=1, cache=None):
        texts = [prompt] + ([negative] if negative is not None else [])
        program = P.TextEncodeProgram(texts, [self.te.token_count(t) for t in texts])
        embeds = None
        async for out in self.text.generate(rid, program):
            if isinstance(out, PromptEmbeds):
                embeds = out
        session = self.cache_factory(cache, n) if cache else None
        call = DenoiseCall(request_id=rid, n=n, height=SIZE, width=SIZE, num_steps=steps, seed=seed,
                           true_cfg_scale=cfg)
        dit = P.DenoiseProgram(self.dn, call, session)

        async def one(item):
            yield item
        latents = metrics = None
        async for out in self.dit.generate(rid, dit, one(embeds)):
            if isinstance(out, FinalLatents):
                latents = out
            else:
                metrics = out.model_dump()
        images = []
        async for out in self.vae.generate(rid, P.DecodeProgram(SIZE, SIZE), one(latents)):
            images += P.encode_images(out.pixels)
        return Result(latents.latents, np.stack([decode_png(b) for b in images])), metrics


def decode_png(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


CASES = [
    ("a red cat under a blue sky", None, 1, 4, 1.0, 1),
    ("dog", "blurry", 2, 3, 4.0, 1),  # true CFG
    ("a house by the sea with a long road", None, 3, 5, 1.0, 2),  # two images, one generator
    ("green tree", " ", 4, 6, 2.5, 1),  # CFG with a blank negative prompt
]


def test_single_requests_equal_the_pipeline(parts):
    pipe, te, dn, de = parts
    for prompt, negative, seed, steps, cfg, n in CASES[:2]:
        async def go():
            eng = InProcessImage(te, dn, de)
            try:
                return await eng.run("r", prompt, negative, seed, steps, cfg, n)
            finally:
                await eng.close()
        got, metrics = asyncio.run(go())
        assert_matches(got, reference(pipe, prompt, negative, seed, steps, cfg, n), prompt)
        assert metrics["num_steps"] == steps and metrics["computed_steps"] == steps
        assert metrics["true_cfg"] == (negative is not None and cfg > 1)


def test_batched_at_different_timesteps_equal_the_pipeline(parts):
    check_batched_at_different_timesteps(*parts)


def check_batched_at_different_timesteps(pipe, te, dn, de, atol: float = LATENT_ATOL, pixel_levels: int = 1):
    """CASES join the DiT one after another (case i after i steps ran) and share its forwards; each equals the
    pipeline (``pipe``, on the stages' device), and the reference with another case's prompt or seed fails the
    same comparison. Also run on CUDA (tests/unit/test_gpu_engines.py)."""
    async def go():
        eng = InProcessImage(te, dn, de)
        compute = eng.dit.compute

        def paced(works):  # a slower step, so a request joining mid-loop surely finds the others running
            time.sleep(0.02)
            return compute(works)
        eng.dit.compute = paced
        try:
            async def staggered(i, case):
                while eng.dit.counters["items"] < i:  # join after i steps ran (progress, not wall time)
                    await asyncio.sleep(0.001)
                return await eng.run(f"r{i}", *case)
            results = await asyncio.gather(*(staggered(i, c) for i, c in enumerate(CASES)))
            return results, dict(eng.dit.counters)
        finally:
            await eng.close()
    results, counters = asyncio.run(go())
    for i, (case, (got, _)) in enumerate(zip(CASES, results)):
        positive = assert_matches(got, reference(pipe, *case), case[0], pixel_levels, atol)
        # Negative controls: the reference with the next case's prompt, or its seed, fails the same comparison.
        other = CASES[(i + 1) % len(CASES)]
        swapped = {"prompt": reference(pipe, other[0], *case[1:]),
                   "seed": reference(pipe, *case[:2], other[2], *case[3:])}
        assert_swaps_fail(got, swapped, positive, case[0], pixel_levels, atol)
    total_steps = sum(c[3] for c in CASES)
    assert counters["items"] == total_steps
    assert counters["calls"] < total_steps  # steps of different requests shared forwards


def test_abort_between_steps_leaves_others_intact(parts):
    pipe, te, dn, de = parts

    async def go():
        eng = InProcessImage(te, dn, de)
        try:
            victim = asyncio.create_task(eng.run("victim", "a cat", None, 5, 30, 1.0))
            survivor = asyncio.create_task(eng.run("ok", *CASES[0]))
            while eng.dit.counters["items"] < 3:
                await asyncio.sleep(0.01)
            victim.cancel()
            with pytest.raises(asyncio.CancelledError):
                await victim
            got, _ = await survivor
            return got, eng.dit.stats()
        finally:
            await eng.close()
    got, stats = asyncio.run(go())
    assert stats["active"] == 0
    assert_matches(got, reference(pipe, *CASES[0][:5]), "survivor")


def _cache_settings(mode, threshold=0.5, warmup=1):
    from omni_serve.kits.diffusion.params import CacheSpec

    return CacheSpec(mode=mode, residual_diff_threshold=threshold, max_warmup_steps=warmup).settings()


@pytest.fixture(scope="module")
def cached_parts(qwen_image_tiny_dir):
    """A second denoiser with cache-dit enabled (its plain forward stays uncached)."""
    from omni_serve.kits.diffusion.replica.cache import DiTCache

    dn = QwenImageDenoiser(qwen_image_tiny_dir)
    return dn, DiTCache(dn, _cache_settings("dbcache"))


def test_a_cache_session_closed_during_a_forward_keeps_its_contexts_until_the_forward_ends(cached_parts):
    """An abort closes the session from another thread: a forward holding it (``use``) keeps its contexts; they
    are dropped when it lets go, and later forwards see a closed session (they compute uncached)."""
    _, cache = cached_parts
    session = cache.session(_cache_settings("dbcache"), 1)
    with session.use() as usable:
        assert usable
        session.close()
        assert not session.closed and set(session.contexts) == {"cond", "uncond"}
    assert session.closed and not session.contexts
    with session.use() as usable:
        assert not usable
    session.close()  # idempotent
    assert session.closed


def test_cache_reports_cached_steps_and_does_not_leak_into_uncached_requests(parts, cached_parts):
    pipe, te, _, de = parts
    dn, cache = cached_parts
    settings = _cache_settings("dbcache", threshold=0.5)
    taylor = _cache_settings("taylorseer", threshold=0.5)

    async def go():
        eng = InProcessImage(te, dn, de, cache_factory=None)
        eng.cache_factory = cache.session
        try:
            return await asyncio.gather(
                eng.run("c1", "a red cat under a blue sky", "blurry", 7, 10, 4.0, cache=settings),
                eng.run("c2", "a red cat under a blue sky", None, 7, 10, 1.0, cache=taylor),
                eng.run("plain", *CASES[0]))
        finally:
            await eng.close()
    (cached, m1), (_, m2), (plain, m3) = asyncio.run(go())
    assert m1["cached_steps"] > 0 and m1["computed_steps"] + m1["cached_steps"] == 10
    assert m2["cached_steps"] > 0
    assert m3["cached_steps"] == 0 and m3["computed_steps"] == CASES[0][3]
    # The uncached request, batched next to cached ones on a cache-enabled transformer, is still exact.
    assert_matches(plain, reference(pipe, *CASES[0][:5]), "uncached next to cached")
    # Cached output is an approximation: close to, but not equal to, the uncached image.
    exact = reference(pipe, "a red cat under a blue sky", "blurry", 7, 10, 4.0)
    assert not np.array_equal(cached.pixels, exact.pixels)
    # Sessions bind their contexts only for their own forwards: the manager holds just its default one.
    assert list(cache.manager._cached_context_manager) == [cache.slot]


def test_cached_request_equals_the_pipeline_with_cache_dit(qwen_image_tiny_dir, parts, cached_parts):
    """Oracle for the cached path: diffusers' pipeline with cache-dit enabled the standard way."""
    import cache_dit
    from cache_dit import DBCacheConfig
    from diffusers import QwenImagePipeline

    _, te, _, de = parts
    dn, cache = cached_parts
    settings = _cache_settings("dbcache", threshold=0.5)
    pipe = QwenImagePipeline.from_pretrained(qwen_image_tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(
        Fn_compute_blocks=settings.fn_compute_blocks, Bn_compute_blocks=settings.bn_compute_blocks,
        residual_diff_threshold=settings.residual_diff_threshold, max_warmup_steps=settings.max_warmup_steps,
        enable_separate_cfg=True))
    ref = reference(pipe, "a red cat under a blue sky", "blurry", 7, 10, 4.0)

    async def go():
        eng = InProcessImage(te, dn, de)
        eng.cache_factory = cache.session
        try:
            return await eng.run("c", "a red cat under a blue sky", "blurry", 7, 10, 4.0, cache=settings)
        finally:
            await eng.close()
    got, metrics = asyncio.run(go())
    assert metrics["cached_steps"] > 0
    assert_matches(got, ref, "cached")


def _pipeline_with_cache_dit(checkpoint, settings, true_cfg: bool):
    import cache_dit
    from cache_dit import DBCacheConfig
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    cache_dit.enable_cache(pipe, cache_config=DBCacheConfig(
        Fn_compute_blocks=settings.fn_compute_blocks, Bn_compute_blocks=settings.bn_compute_blocks,
        residual_diff_threshold=settings.residual_diff_threshold, max_warmup_steps=settings.max_warmup_steps,
        enable_separate_cfg=true_cfg))  # under true CFG the pipeline's uncond forward has state of its own
    return pipe


def test_cached_requests_share_the_batched_forward_and_each_equals_the_pipeline_with_cache_dit(
        qwen_image_tiny_dir, parts, cached_parts):
    """Row-batched DBCache: two cached requests (different prompts, seeds, thresholds, one with true CFG and two
    images per prompt) and an uncached one step in the same transformer forwards; each cached request's latents
    equal diffusers' pipeline with cache-dit run alone on it, the uncached one the plain pipeline; swapped
    references fail."""
    pipe, te, _, de = parts
    dn, cache = cached_parts
    loose, tight = _cache_settings("dbcache", threshold=0.5), _cache_settings("dbcache", threshold=0.45, warmup=2)
    jobs = {"c1": ("a red cat under a blue sky", "blurry", 7, 10, 4.0, 2, loose),
            "c2": ("green tree by a lake", None, 3, 10, 1.0, 1, tight)}
    refs = {rid: reference(_pipeline_with_cache_dit(qwen_image_tiny_dir, settings, job[4] > 1), *job)
            for rid, (*job, settings) in jobs.items()}
    plain_ref = reference(pipe, *CASES[1][:5])
    mixed = []  # per forward: (cached works, uncached works)

    async def go():
        eng = InProcessImage(te, dn, de)
        eng.cache_factory = cache.session
        compute = eng.dit.compute

        def recording(works):
            if not works[0].alone:
                cached = sum(w.cache_session is not None for w in works)
                mixed.append((cached, len(works) - cached))
            return compute(works)
        eng.dit.compute = recording
        try:
            return await asyncio.gather(*(eng.run(rid, *job[:6], cache=job[6]) for rid, job in jobs.items()),
                                        eng.run("plain", *CASES[1]))
        finally:
            await eng.close()
    (c1, m1), (c2, m2), (plain, m3) = asyncio.run(go())
    assert max(c for c, u in mixed if u) == 2, f"cached and uncached requests never shared a forward: {mixed}"
    assert m1["cached_steps"] > 0 and m2["cached_steps"] > 0 and m3["cached_steps"] == 0
    d1 = assert_matches(c1, refs["c1"], "cached, batched")
    assert_matches(c2, refs["c2"], "cached (other settings), batched")
    assert_matches(plain, plain_ref, "uncached, batched with cached ones")
    other_seed = (*jobs["c1"][:2], 8, *jobs["c1"][3:6])
    assert_swaps_fail(c1, {"another seed": reference(_pipeline_with_cache_dit(qwen_image_tiny_dir, loose, True),
                                                     *other_seed), "no cache": reference(
        pipe, *jobs["c1"][:6])}, d1, "row-batched DBCache")


def test_large_images_decode_in_tiles(qwen_image_tiny_dir, parts):
    """Above ``tile_min_pixels`` the VAE decodes in overlapping tiles (bounded memory): same image size,
    close to the whole-image decode (tiles are blended, so not bit-equal)."""
    _, _, _, whole = parts
    tiled = QwenImageDecoder(qwen_image_tiny_dir, tile_min_pixels=64, tile_stride_pixels=48)
    assert tiled.vae.use_tiling and not whole.vae.use_tiling
    latents = torch.randn(1, (160 // 16) ** 2, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        a, b = whole.decode(latents, 160, 160), tiled.decode(latents, 160, 160)
    assert a.shape == b.shape == (1, 160, 160, 3)
    diff = np.abs(a.astype(int) - b)
    assert 0 < diff.mean() < 20
