"""The per-token machinery of VibeVoice's lm stage that is not the positive LM pass: the two side branches' paged KV
cache, the diffusion head's sampler and the streaming tokenizers' per-request padding caches, each batched across
the requests of one AR engine step (``omni_serve.models.vibevoice.VibeVoiceLM.run_followups`` drives them), and the
per-request state they keep.

Contract:

- ``SpeechState``: one request's state between tokens, owned by the model and touched only on the engine's worker
  thread: its generator, its settings, the uncond-token branch's input ids and the negative branch's committed input
  rows (what their KV is recomputed from when it is lost: ``*_done`` counts the rows in ``BranchKV``), and the
  tokenizers' padding caches. ``TokenStep`` is a sequence's follow-up (its step's logits, last hidden state and the
  negative branch's input row), ``TokenResult`` the model's answer (the token, the next positive row, and for speech
  the latent and its samples; ``error`` when the request could not be served).

- ``BranchKV(layers, kv_heads, head_dim, num_blocks, block_size, dtype, device)``: a ``PagedKVCache`` and its
  ``BlockAllocator`` for the rows of the *negative* branch (the diffusion head's unconditional condition) and the
  *uncond-token* branch (transformers' token CFG pass) of every request, keyed ``(key, branch)``. ``plan(segments)``
  allocates what each segment's new rows need and returns the ``PagedBatch`` of one packed forward over all of them;
  a request that cannot get blocks even after evicting the branches of requests outside the call (least recently
  used first; ``on_evict(key)`` tells the owner, and they recompute their rows from their stored inputs next time)
  is refused instead (left out of the batch, holding nothing). ``free(key)`` drops a request's rows (release,
  abort, preemption).
- ``DiffusionSampler(head, scheduler_factory)``: ``sample(pos, neg, noise, scales, steps)``: generate's
  ``_sample_audio_latent`` for ``n`` requests at once: the head on ``cat(x, x)`` conditioned on ``cat(pos, neg)``,
  per-row CFG scale, ``scheduler.step`` on the ``n`` guided rows. Every operation after the head is elementwise per
  row, so a row's latent is the one ``generate`` computes alone (up to the head's matrix products, which may round
  differently at another batch size). One scheduler per step count, reset by ``set_timesteps`` at every call as
  ``generate`` resets its own.
- ``ConvStreams(module, call)``: per-request streaming state of a causal conv model (the acoustic decoder, the
  semantic encoder): ``run(states, x)`` runs ``call(module, x [n, ...], cache)`` once for ``n`` requests by
  stacking their padding caches along dim 0 (zeros for a request's first call, as transformers' lazy init), and
  returns the output and each request's new state (its slice of the updated caches).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from omni_serve.engines.ar.attention import PagedBatch
from omni_serve.engines.ar.kv_cache import BlockAllocator, PagedKVCache

NEGATIVE, UNCOND = "n", "u"


# -- per-request state (owned by the model, touched only on the engine's worker thread) ------------------------
@dataclass
class SpeechState:
    key: str
    generator: torch.Generator
    guidance_scale: float
    num_diffusion_steps: int
    unc_ids: list[int]  # the uncond-token branch's inputs: [last prompt id, generated ids...]
    unc_done: int = 0  # of them in the branch cache
    neg_buffer: torch.Tensor | None = None  # the negative branch's committed input rows (first neg_count rows)
    neg_count: int = 0
    neg_done: int = 0  # of them in the branch cache
    acoustic: dict | None = None  # padding caches of the acoustic decoder (None: zeros, first call)
    semantic: dict | None = None  # of the semantic encoder

    def negative_rows(self, start: int) -> torch.Tensor:
        return self.neg_buffer[start:self.neg_count]

    def commit_negative(self, row: torch.Tensor) -> None:
        if self.neg_buffer is None or self.neg_count == self.neg_buffer.shape[0]:
            grown = row.new_empty(max(16, 2 * self.neg_count), row.shape[-1])
            if self.neg_count:
                grown[:self.neg_count] = self.neg_buffer[:self.neg_count]
            self.neg_buffer = grown
        self.neg_buffer[self.neg_count] = row
        self.neg_count += 1


@dataclass
class TokenStep:
    """A sequence's follow-up: the positive branch's logits ``[V]`` and last hidden state ``[H]`` at one step, and
    the negative branch's input row ``[H]`` for the step."""

    state: SpeechState
    logits: torch.Tensor
    hidden: torch.Tensor
    negative_row: torch.Tensor
    input_ids: list[int] | None = None  # prompt + generated ids, for the request's logits_processor
    logits_processor: Callable | None = None


@dataclass
class TokenResult:
    token: int
    next_row: torch.Tensor | None = None  # [H] the next positive input row
    latent: torch.Tensor | None = None  # [D] speech tokens only
    samples: torch.Tensor | None = None  # [hop] float32, speech tokens only
    error: Exception | None = None


@dataclass
class SideResult:
    """What the side forward gave one step: the uncond logits and the negative hidden state."""

    uncond: torch.Tensor | None = None
    negative: torch.Tensor | None = None
    error: Exception | None = None


# -- side branches' KV ---------------------------------------------------------------------------------------
@dataclass
class BranchSegment:
    """New rows of one request's branch in a packed side forward: rows ``[done, done + n)`` of ``(key, branch)``."""

    key: str
    branch: str
    done: int  # rows already in the cache
    n: int  # new rows


class BranchKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device):
        self.cache = PagedKVCache(num_layers, num_kv_heads, head_dim, num_blocks, block_size, dtype, device)
        self.blocks = BlockAllocator(num_blocks, block_size)
        self._last_use: OrderedDict[str, None] = OrderedDict()  # keys holding blocks, least recently used first
        self.evictions = 0
        self.on_evict: Callable[[str], None] | None = None  # tells the owner a key's rows are gone

    @staticmethod
    def rid(key: str, branch: str) -> str:
        return f"{key}/{branch}"

    def holds(self, key: str) -> bool:
        return key in self._last_use

    def free(self, key: str) -> None:
        for branch in (NEGATIVE, UNCOND):
            self.blocks.free(self.rid(key, branch))
        self._last_use.pop(key, None)

    def free_branch(self, key: str, branch: str) -> None:
        self.blocks.free(self.rid(key, branch))

    def evict_one(self, protected: set[str] | frozenset = frozenset()) -> bool:
        """Free the least recently used key's rows (not one of ``protected``); False when there is none."""
        victim = next((k for k in self._last_use if k not in protected), None)
        if victim is None:
            return False
        self.free(victim)
        self.evictions += 1
        if self.on_evict is not None:
            self.on_evict(victim)
        return True

    def plan(self, segments: list[BranchSegment]) -> tuple[PagedBatch | None, list[str]]:
        """Allocate blocks for every segment and build their packed batch. Returns (batch over the segments that
        got blocks, in order, or None if none did; keys refused for lack of blocks: their segments are left out)."""
        protected = {s.key for s in segments}
        refused: list[str] = []
        for s in segments:
            if s.key in refused:
                continue
            while not self.blocks.allocate(self.rid(s.key, s.branch), s.done + s.n):
                if not self.evict_one(protected):
                    refused.append(s.key)
                    self.free(s.key)  # all or nothing per request: a refused request holds nothing
                    break
        for s in segments:
            if s.key not in refused:
                self._last_use[s.key] = None
                self._last_use.move_to_end(s.key)
        kept = [s for s in segments if s.key not in refused]
        if not kept:
            return None, refused
        parts = []
        for s in kept:
            read = self.blocks.slots(self.rid(s.key, s.branch), 0, s.done + s.n)
            parts.append((self.rid(s.key, s.branch), s.n, read[s.done:], read))
        return PagedBatch.build(self.cache, parts), refused

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_used_blocks


# -- diffusion head ------------------------------------------------------------------------------------------
class DiffusionSampler:
    def __init__(self, head: torch.nn.Module, scheduler_factory: Callable[[], object]):
        self.head = head
        self._factory = scheduler_factory
        self._schedulers: dict[int, object] = {}

    def scheduler(self, steps: int):
        if steps not in self._schedulers:
            self._schedulers[steps] = self._factory()
        return self._schedulers[steps]

    @torch.inference_mode()
    def sample(self, pos: torch.Tensor, neg: torch.Tensor, noise: torch.Tensor, scales: torch.Tensor,
               steps: int) -> torch.Tensor:
        """Latents ``[n, D]`` for conditions ``pos``/``neg`` ``[n, H]``, initial noise ``[n, D]`` and CFG scales
        ``[n, 1]``, in ``steps`` solver steps (generate's ``_sample_audio_latent`` on each row)."""
        scheduler = self.scheduler(steps)
        scheduler.set_timesteps(num_inference_steps=steps)
        n = pos.shape[0]
        condition = torch.cat([pos, neg], dim=0)
        x = noise.to(condition)
        for t in scheduler.timesteps:
            eps = self.head(torch.cat([x, x], dim=0), t.repeat(2 * n).to(x), condition=condition)
            cond, uncond = torch.split(eps, n, dim=0)
            guided = uncond + scales * (cond - uncond)
            # generate steps cat(guided, guided) over [x, wasted noise]; each row's update reads only that row
            x = scheduler.step(guided, t, x).prev_sample
        return x


# -- streaming tokenizers ------------------------------------------------------------------------------------
StreamState = dict  # cache key -> [1, C, left_pad] tensor: one request's padding caches of one conv model


class ConvStreams:
    def __init__(self, module: torch.nn.Module, call: Callable, probe: torch.Tensor):
        """``call(module, x, cache) -> (output, cache)``; ``probe``: a one-request input that reveals the cache
        layout (every cache key, its channels and left padding)."""
        from transformers.models.vibevoice_acoustic_tokenizer.modeling_vibevoice_acoustic_tokenizer import (
            VibeVoiceAcousticTokenizerConv1dCacheLayer, VibeVoiceAcousticTokenizerConv1dPaddingCache)

        self._layer_cls = VibeVoiceAcousticTokenizerConv1dCacheLayer
        self._cache_cls = VibeVoiceAcousticTokenizerConv1dPaddingCache
        self.module, self.call = module, call
        with torch.inference_mode():
            _, cache = call(module, probe, None)
        self.layout = {key: (layer.in_channels, layer.left_pad, layer.cache.dtype, layer.cache.device)
                       for key, layer in cache.layers.items()}

    def _stack(self, states: list[StreamState | None]):
        cache = self._cache_cls()
        for key, (channels, pad, dtype, device) in self.layout.items():
            layer = self._layer_cls()
            layer.left_pad, layer.in_channels, layer.is_initialized = pad, channels, True
            layer.cache = torch.cat([s[key] if s is not None else torch.zeros(1, channels, pad, dtype=dtype,
                                                                               device=device) for s in states])
            cache.layers[key] = layer
        return cache

    @torch.inference_mode()
    def run(self, states: list[StreamState | None], x: torch.Tensor) -> tuple[torch.Tensor, list[StreamState]]:
        out, cache = self.call(self.module, x, self._stack(states))
        new = [{key: layer.cache[i:i + 1].clone() for key, layer in cache.layers.items()} for i in range(len(states))]
        return out, new
