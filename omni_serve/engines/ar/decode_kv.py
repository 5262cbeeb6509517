"""A contiguous copy of the decode batch's keys/values, kept from one step to the next.

Why: decoding attends each request's one new query to all its cached keys. Read straight from the paged
cache, that is a gather of ``[B, L, kv_heads, head_dim]`` per layer and step, and on CPU the gather costs
twice the attention itself (Qwen2.5-Omni talker at 8 in flight: 23% of the stage's time). Between two
steps of a steady batch only one token per request is new, so this module keeps the batch's KV in one
contiguous tensor per layer and appends that token in place; attention then reads a view.

Contract:
- ``DecodeKV(layers, kv_heads, head_dim, dtype, device, budget_bytes)``; once per step the attention
  builder calls ``plan(ids, lengths, slots)`` with the decode rows' request ids (packed order), each one's
  KV length *including* this step's token, and the padded cache rows ``[B, L]`` they read. It returns a
  ``DecodeKVStep`` the layers use, or None when the copy would exceed ``budget_bytes`` (the caller then
  gathers from the paged cache as before).
- The copy is reused when the step's ids equal the last step's, in the same order, and every length grew
  by exactly one; otherwise (a request joined, left, was preempted, prefilled a chunk) every layer
  rebuilds it from the paged cache, which is the old gather's cost once. Values are copies of the paged
  cache's, so attention results are bit-identical to reading the cache.
- Rows past a request's length hold finite values (zeros or another request's keys) and are masked.
- ``invalidate()`` drops the reuse state (the engine calls it when a forward fails part-way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CAPACITY_STEP = 128  # the copy's length grows in steps of this many tokens (one rebuild per step)


@dataclass
class DecodeKVStep:
    """What one forward's layers need: where the copy lives and what to write into it."""

    k: torch.Tensor  # [layers, B, kv_heads, capacity, head_dim] (each head's keys contiguous for attention)
    v: torch.Tensor
    length: int  # longest decode row this step (the attention's key length)
    append_at: torch.Tensor | None  # [B] position of each row's new token when reusing the copy
    rebuild_slots: torch.Tensor | None  # [B, length] cache rows to gather when rebuilding

    def keys_values(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, new_k: torch.Tensor,
                    new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring layer ``layer``'s copy up to date (``new_k``/``new_v``: ``[B, kv_heads, d]``, already in the
        paged cache) and return keys/values ``[B, kv_heads, length, d]`` as views of it."""
        k, v = self.k[layer], self.v[layer]
        if self.rebuild_slots is not None:
            k[:, :, :self.length] = k_cache[self.rebuild_slots].transpose(1, 2)
            v[:, :, :self.length] = v_cache[self.rebuild_slots].transpose(1, 2)
        else:
            rows = torch.arange(k.shape[0], device=k.device)
            k[rows, :, self.append_at] = new_k.to(k.dtype)
            v[rows, :, self.append_at] = new_v.to(v.dtype)
        return k[:, :, :self.length], v[:, :, :self.length]


class DecodeKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device, budget_bytes: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.budget_bytes = budget_bytes
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._ids: tuple[str, ...] = ()
        self._lengths: list[int] = []
        self.rebuilds = 0  # counters, for tests and stats
        self.appends = 0

    def bytes_for(self, rows: int, capacity: int) -> int:
        per_token = self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * rows * capacity * per_token

    def invalidate(self) -> None:
        self._ids, self._lengths = (), []

    def release(self) -> None:
        self.invalidate()
        self._k = self._v = None

    def plan(self, ids: list[str], lengths: list[int], slots: torch.Tensor) -> DecodeKVStep | None:
        rows, longest = len(ids), max(lengths)
        reuse = (tuple(ids) == self._ids and self._k is not None and longest <= self._k.shape[3]
                 and all(n == old + 1 for n, old in zip(lengths, self._lengths)))
        if not reuse:
            capacity = -(-longest // _CAPACITY_STEP) * _CAPACITY_STEP
            if self.bytes_for(rows, capacity) > self.budget_bytes:
                self.release()
                return None
            if self._k is None or self._k.shape[1] != rows or self._k.shape[3] < longest:
                shape = (self.num_layers, rows, self.num_kv_heads, capacity, self.head_dim)
                self._k = self._v = None  # free the old copy before allocating the new one
                self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.rebuilds += 1
        else:
            self.appends += 1
        self._ids, self._lengths = tuple(ids), list(lengths)
        if reuse:
            append_at = torch.tensor(lengths, dtype=torch.long, device=self.device) - 1
            return DecodeKVStep(self._k, self._v, longest, append_at, None)
        return DecodeKVStep(self._k, self._v, longest, None, slots.to(self.device))
