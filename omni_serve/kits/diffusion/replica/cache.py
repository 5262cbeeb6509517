"""Cache acceleration of the DiT stage through cache-dit (DBCache, optionally with the TaylorSeer calibrator).

Contract: ``DiTCache(denoiser, defaults)`` (a ``CacheSettings``) enables cache-dit once on the replica's transformer
and points the denoiser's plain (uncached) forward at the original forward, so requests without caching are
untouched. ``session(settings, num_images)`` gives one request a ``CacheSession``: its own cache-dit context per
CFG branch (cond, uncond), created fresh, with the request's own config; ``counts()`` reports computed vs cached
steps; ``close()`` drops the contexts and their residual buffers (called when the request ends or is aborted).

Two ways to run a cached request's step, with the same decisions and results (to float rounding):
- **Row-batched** (``RowCache``, used whenever the denoiser's packed forward covers the transformer): cached
  requests share the DiT's one batched forward with everyone else. The first ``Fn`` blocks run on every row; then,
  for each cached request's branch, cache-dit's own logic (``CachedContextManager.can_cache`` etc. under that
  branch's context, on that branch's rows only) decides from its ``Fn`` residual whether the step is cached; the
  middle blocks run only on the rows that compute (uncached requests and cached ones that decided to compute),
  cached rows add their stored residuals (``apply_cache``), and the last ``Bn`` blocks run on every row again.
  Every call cache-dit's ``CachedBlocks.forward`` makes for a request is made for it, in the same order, on its own
  rows only, so its decisions and buffers are what they would be alone, up to the float rounding of the batched
  matrix products (a residual within rounding of the threshold could tip either way, as it could between two
  runs of cache-dit's own path at different batch sizes).
- **Per request** (``CacheSession.predict``): each branch's rows in their own forward through cache-dit's patched
  transformer, the context bound under cache-dit's fixed slot name for the duration of the forward (``_bound``:
  cache-dit looks its context up by that name on every forward and has no API to run one under a caller-chosen
  context). Kept for transformer variants the packed forward does not cover.

Forwards on one transformer happen on the engine's single worker thread, so contexts are never contended; a
request aborted from another thread closes its session only once the forward using it is over (``use``).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from dataclasses import dataclass

import torch

from omni_serve.kits.diffusion.messages import CacheSettings
from omni_serve.models.diffusion_rows import DenoiseRow
from omni_serve.models.qwen_image import QwenImageDenoiser

BRANCHES = ("cond", "uncond")
PREFIX = "omni_rows"  # names of the row-batched path's buffers inside a request's own contexts


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
    def active(self, context):
        """``context`` is the manager's current context (what its methods act on) for the block's duration."""
        previous = self.manager._current_context
        self.manager.set_context(context)
        try:
            yield self.manager
        finally:
            self.manager._current_context = previous

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

        self.cache, self.num_images, self.settings = cache, num_images, settings
        # ``close`` may come from any thread (an abort) while a forward on the engine thread uses the contexts:
        # it then waits for that forward to let go (``use``), so a shared forward never loses a partner's buffers
        self._lock = threading.Lock()
        self._users = 0
        self._close_pending = False
        self.closed = False
        cache_cfg, calibrator = _configs(settings)
        self.contexts = {
            branch: CachedContext(name=cache.slot, cache_config=copy.deepcopy(cache_cfg),
                                  calibrator_config=copy.deepcopy(calibrator))
            for branch in BRANCHES}

    def predict(self, rows: list[DenoiseRow], grid: tuple[int, int],
                condition_grid: tuple[int, int] | None = None) -> torch.Tensor:
        with self.use() as usable:
            if not usable:  # aborted meanwhile: its result is dropped; compute it plainly
                return self.cache.denoiser.predict(rows, grid, forward=self.cache.denoiser.plain_forward,
                                                   condition_grid=condition_grid)
            return self._predict(rows, grid, condition_grid)

    def _predict(self, rows: list[DenoiseRow], grid: tuple[int, int],
                 condition_grid: tuple[int, int] | None) -> torch.Tensor:
        n = self.num_images
        outs = []
        for i, branch in enumerate(BRANCHES[:len(rows) // n]):
            with self.cache._bound(self.contexts[branch]):
                outs.append(self.cache.denoiser.predict(rows[i * n:(i + 1) * n], grid,
                                                        forward=self.cache.transformer,
                                                        condition_grid=condition_grid))
        return torch.cat(outs)

    def branches(self, num_rows: int) -> list[tuple[str, slice]]:
        """(branch, its rows within this request's ``num_rows`` rows): cond first, then uncond under true CFG."""
        n = self.num_images
        return [(branch, slice(i * n, (i + 1) * n)) for i, branch in enumerate(BRANCHES[:num_rows // n])]

    def counts(self) -> StepCounts:
        ctx = self.contexts["cond"]
        return StepCounts(executed=ctx.get_accumulated_executed_steps(), cached=ctx.get_accumulated_cached_steps())

    @contextlib.contextmanager
    def use(self):
        """Hold the contexts for one forward; yields False (and holds nothing) when the session is closed."""
        with self._lock:
            usable = not (self.closed or self._close_pending)
            if usable:
                self._users += 1
        try:
            yield usable
        finally:
            if usable:
                with self._lock:
                    self._users -= 1
                    close_now = self._users == 0 and self._close_pending
                if close_now:
                    self._clear()

    def close(self) -> None:
        """Drop the contexts and their buffers: now, or when the forward using them ends."""
        with self._lock:
            if self.closed or self._close_pending:
                return
            if self._users:
                self._close_pending = True
                return
        self._clear()

    def _clear(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
        for ctx in self.contexts.values():
            ctx.clear_buffers()
            # TaylorSeer state lives in the calibrators, not in the buffers.
            ctx.calibrator = ctx.encoder_calibrator = None
            ctx.cfg_calibrator = ctx.cfg_encoder_calibrator = None
        self.contexts.clear()


@dataclass
class _Group:
    context: object
    rows: list[int]  # rows of the batched forward
    cached: bool = False


class RowCache:
    """One batched forward's DBCache decisions (see the module docstring): a group per cached request's CFG branch,
    over that branch's rows of the batch; the other rows always compute."""

    def __init__(self, sessions: list[tuple["CacheSession", int, int]]):
        """``sessions``: (session, its first row, its row count) of each cached request; they share Fn and Bn."""
        blocks = {(s.settings.fn_compute_blocks, s.settings.bn_compute_blocks) for s, _, _ in sessions}
        if len(blocks) != 1:
            raise ValueError(f"one batched forward needs one Fn/Bn block split, got {sorted(blocks)}")
        self.cache = sessions[0][0].cache
        (self.fn_blocks, self.bn_blocks), = blocks
        self.groups = [_Group(session.contexts[branch], list(range(first + part.start, first + part.stop)))
                       for session, first, count in sessions for branch, part in session.branches(count)]

    def decide(self, fn_residual: torch.Tensor, img: torch.Tensor, txt: torch.Tensor, layout) -> list[int]:
        """Rows that compute the middle blocks; cached groups are remembered for ``apply``."""
        skip = set()
        for g in self.groups:
            with self.cache.active(g.context) as m:
                l1 = m.is_l1_diff_enabled()
                residual = fn_residual[g.rows]
                m.mark_step_begin()
                g.cached = m.can_cache(img[g.rows] if l1 else residual,
                                       prefix=f"{PREFIX}_Fn_hidden_states" if l1 else f"{PREFIX}_Fn_residual")
                if g.cached:
                    m.add_cached_step()
                    skip.update(g.rows)
                else:
                    m.set_Fn_buffer(residual, prefix=f"{PREFIX}_Fn_residual")
                    if l1:
                        m.set_Fn_buffer(img[g.rows], f"{PREFIX}_Fn_hidden_states")
        return [r for r in range(img.shape[0]) if r not in skip]

    def computed(self, rows: list[int], img_residual: torch.Tensor, txt_residual: torch.Tensor, img: torch.Tensor,
                 txt: torch.Tensor, layout) -> None:
        """The middle blocks ran on ``rows`` (tensors over those rows, text packed by ``layout``): store what each
        computing cached group keeps for its next cached steps."""
        where = {r: i for i, r in enumerate(rows)}
        for g in self.groups:
            if g.cached:
                continue
            pos = [where[r] for r in g.rows]
            tok = layout.tokens(pos)
            with self.cache.active(g.context) as m:
                if m.is_cache_residual():
                    m.set_Bn_buffer(img_residual[pos], prefix=f"{PREFIX}_Bn_residual")
                else:
                    m.set_Bn_buffer(img[pos], prefix=f"{PREFIX}_Bn_hidden_states")
                if m.is_encoder_cache_residual():
                    m.set_Bn_encoder_buffer(txt_residual[tok], prefix=f"{PREFIX}_Bn_residual")
                else:
                    m.set_Bn_encoder_buffer(txt[tok], prefix=f"{PREFIX}_Bn_hidden_states")

    def apply(self, img: torch.Tensor, txt: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached groups' rows with their stored middle-block residuals (or states) applied."""
        cached = [g for g in self.groups if g.cached]
        if not cached:
            return img, txt
        img, txt = img.clone(), txt.clone()
        for g in cached:
            tok = layout.tokens(g.rows)
            with self.cache.active(g.context) as m:
                residual, enc = m.is_cache_residual(), m.is_encoder_cache_residual()
                img[g.rows], txt[tok] = m.apply_cache(
                    img[g.rows], txt[tok],
                    prefix=f"{PREFIX}_Bn_residual" if residual else f"{PREFIX}_Bn_hidden_states",
                    encoder_prefix=f"{PREFIX}_Bn_residual" if enc else f"{PREFIX}_Bn_hidden_states")
        return img, txt
