"""Cache acceleration of the DiT stage through cache-dit (DBCache, optionally with the TaylorSeer calibrator).

Contract: ``DiTCache(denoiser, defaults)`` (a ``CacheSettings``) enables cache-dit once on the replica's transformer and points the
denoiser's plain (uncached) forward at the original forward, so requests without caching are untouched.
``session(settings, num_images)`` gives one request a ``CacheSession``: its own cache-dit context per CFG
branch (cond, uncond), created fresh, with the request's own config; ``predict(rows, grid)`` runs the
request's step with each branch under its context; ``counts()`` reports computed vs cached steps;
``close()`` drops the contexts and their residual buffers (called when the request ends or is aborted).

Why per request and not per batch: cache-dit decides to compute or reuse once per forward, from the whole
batch tensor, and keeps one set of residual buffers per context. Rows of different requests in one cached
forward would share decisions and buffers, so a request's image would depend on its batch partners.
Cached requests therefore run their own forwards; uncached requests keep step-level batching.

cache-dit looks its context up by a fixed slot name on every forward (``CachedBlocks.forward`` ->
``context_manager.set_context(slot)``), and has no API to run a forward under a caller-chosen context, so a
session binds its context object under that slot for the duration of its forward (``_bound``). Forwards
on one transformer happen on the engine's single worker thread, so the binding is never contended.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
import torch

from omni_serve.graphs.qwen_image.messages import CacheSettings
from omni_serve.models.qwen_image import DenoiseRow, QwenImageDenoiser

BRANCHES = ("cond", "uncond")


@dataclass
class StepCounts:
    executed: int
    cached: int

    @property
    def computed(self) -> int:
        return self.executed - self.cached


def _configs(settings: CacheSettings):
    from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig

    cache = DBCacheConfig(
        Fn_compute_blocks=settings.fn_compute_blocks, Bn_compute_blocks=settings.bn_compute_blocks,
        residual_diff_threshold=settings.residual_diff_threshold,
        max_warmup_steps=settings.max_warmup_steps, max_cached_steps=settings.max_cached_steps,
        max_continuous_cached_steps=settings.max_continuous_cached_steps,
        enable_separate_cfg=False)  # one context per branch, never cache-dit's call-parity CFG split
    calibrator = None
    if settings.mode == "taylorseer":
        calibrator = TaylorSeerCalibratorConfig(taylorseer_order=settings.taylorseer_order)
    return cache, calibrator


class DiTCache:
    def __init__(self, denoiser: QwenImageDenoiser, defaults: CacheSettings):
        import cache_dit

        self.denoiser = denoiser
        self.transformer = denoiser.transformer
        self.num_layers = len(self.transformer.transformer_blocks)
        self.check(defaults)
        cache_cfg, _ = _configs(defaults.model_copy(update={"mode": "dbcache"}))
        cache_dit.enable_cache(self.transformer, cache_config=cache_cfg)
        self.manager = self.transformer._context_manager
        (self.slot,) = self.transformer._context_names
        denoiser.plain_forward = self.transformer._original_forward

    def check(self, settings: CacheSettings) -> None:
        if settings.fn_compute_blocks + settings.bn_compute_blocks > self.num_layers:
            raise ValueError(f"cache fn_compute_blocks + bn_compute_blocks must be <= the transformer's "
                             f"{self.num_layers} blocks")

    def session(self, settings: CacheSettings, num_images: int) -> "CacheSession":
        self.check(settings)
        return CacheSession(self, settings, num_images)

    @contextlib.contextmanager
    def _bound(self, context):
        table = self.manager._cached_context_manager
        previous = table.get(self.slot)
        table[self.slot] = context
        try:
            yield
        finally:
            if previous is not None:
                table[self.slot] = previous
            else:
                table.pop(self.slot, None)
            self.manager._current_context = previous


class CacheSession:
    def __init__(self, cache: DiTCache, settings: CacheSettings, num_images: int):
        from cache_dit.caching import CachedContext

        self.cache, self.num_images = cache, num_images
        cache_cfg, calibrator = _configs(settings)
        self.contexts = {
            branch: CachedContext(name=cache.slot, cache_config=copy.deepcopy(cache_cfg),
                                  calibrator_config=copy.deepcopy(calibrator))
            for branch in BRANCHES}

    def predict(self, rows: list[DenoiseRow], grid: tuple[int, int],
                condition_grid: tuple[int, int] | None = None) -> torch.Tensor:
        n = self.num_images
        outs = []
        for i, branch in enumerate(BRANCHES[:len(rows) // n]):
            with self.cache._bound(self.contexts[branch]):
                outs.append(self.cache.denoiser.predict(rows[i * n:(i + 1) * n], grid,
                                                        forward=self.cache.transformer,
                                                        condition_grid=condition_grid))
        return torch.cat(outs)

    def counts(self) -> StepCounts:
        ctx = self.contexts["cond"]
        return StepCounts(executed=ctx.get_accumulated_executed_steps(), cached=ctx.get_accumulated_cached_steps())

    def close(self) -> None:
        for ctx in self.contexts.values():
            ctx.clear_buffers()
            # TaylorSeer state lives in the calibrators, not in the buffers.
            ctx.calibrator = ctx.encoder_calibrator = None
            ctx.cfg_calibrator = ctx.cfg_encoder_calibrator = None
        self.contexts.clear()
