"""A contiguous copy of the decoding requests' keys/values, kept from one step to the next, one row per request.

Why: decoding attends each request's one new query to all its cached keys. Read straight from the paged
cache, that is a gather of ``[B, L, kv_heads, head_dim]`` per layer and step, and on CPU the gather costs
twice the attention itself (Qwen2.5-Omni talker at 8 in flight: 23% of the stage's time). Between two
steps only one token per request is new, so this module keeps every decoding request's KV in a row of one
contiguous tensor per layer and appends that token in place; attention then reads a view of the used rows.

Rows belong to requests, not to batch positions: a request keeps its row while it decodes, so a batch that
changes (requests joining and leaving every few steps, as under continuous batching at high concurrency)
costs one row's copy per change, not a rebuild of the whole batch:
- a request that joins (or whose KV changed since its last decode step: a prefill chunk, a preemption) gets
  its row filled from the paged cache, once;
- a request that is not decoding this step gives its row up; the last used row moves into the hole (one row
  copy), so the used rows stay ``[0, B)``;
- the tensor grows (rows, or tokens in steps of 128) only when the batch outgrows it, and never past
  ``budget_bytes``.
The rows are therefore not in the batch's packed order: ``DecodeKVStep.order`` maps them (attention permutes
its queries, its mask and its outputs with it).

Contract:
- ``DecodeKV(layers, kv_heads, head_dim, dtype, device, budget_bytes)``; once per step the attention
  builder calls ``plan(ids, lengths, slots)`` with the decode rows' request ids (packed order), each one's
  KV length *including* this step's token, and the padded cache rows ``[B, L]`` they read. It returns a
  ``DecodeKVStep`` the layers use, or None when the copy would exceed ``budget_bytes`` (the caller then
  gathers from the paged cache as before).
- Values are copies of the paged cache's, so attention results are bit-identical to reading the cache.
- Positions past a row's length hold finite values (zeros, or keys of the row's earlier owner) and are masked.
- ``invalidate()`` drops every row (the engine calls it when a forward fails part-way, and the attention
  builder when a step decodes nothing, since a request's KV may then change without the copy seeing it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_CAPACITY_STEP = 128  # the copy's length grows in steps of this many tokens


@dataclass
class DecodeKVStep:
    """What one forward's layers need: where the copy lives and what to write into it."""

    k: torch.Tensor  # [layers, rows capacity, kv_heads, tokens capacity, head_dim] (each head's keys contiguous)
    v: torch.Tensor
    rows: int  # used rows this step (= decode requests); row r holds the request at packed decode index order[r]
    length: int  # longest decode row this step (the attention's key length)
    order: torch.Tensor | None  # [rows] packed decode index of each row; None when rows are in packed order
    append_rows: torch.Tensor | None  # [n] rows that get this step's token appended ...
    append_at: torch.Tensor | None  # [n] ... at this position ...
    append_from: torch.Tensor | None  # [n] ... taken from this packed decode index (None: identity)
    fill_rows: torch.Tensor | None  # [m] rows filled from the paged cache ...
    fill_slots: torch.Tensor | None  # [m, fill_length] ... from these cache rows (this step's token included)

    def keys_values(self, layer: int, k_cache: torch.Tensor, v_cache: torch.Tensor, new_k: torch.Tensor,
                    new_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring layer ``layer``'s copy up to date (``new_k``/``new_v``: ``[B, kv_heads, d]`` in packed decode
        order, already in the paged cache) and return keys/values ``[rows, kv_heads, length, d]`` as views."""
        k, v = self.k[layer], self.v[layer]
        if self.fill_rows is not None:
            n = self.fill_slots.shape[1]
            k[self.fill_rows, :, :n] = k_cache[self.fill_slots].transpose(1, 2).to(k.dtype)
            v[self.fill_rows, :, :n] = v_cache[self.fill_slots].transpose(1, 2).to(v.dtype)
        if self.append_rows is not None:
            ks, vs = new_k, new_v
            if self.append_from is not None:
                ks, vs = new_k[self.append_from], new_v[self.append_from]
            k[self.append_rows, :, self.append_at] = ks.to(k.dtype)
            v[self.append_rows, :, self.append_at] = vs.to(v.dtype)
        return k[:self.rows, :, :self.length], v[:self.rows, :, :self.length]


class DecodeKV:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: str | torch.device, budget_bytes: int):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.budget_bytes = budget_bytes
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._ids: list[str] = []  # the request holding each used row
        self._lengths: list[int] = []  # tokens each used row holds
        self.rebuilds = 0  # counters, for tests and stats: rows filled from the paged cache,
        self.appends = 0  # rows that appended one token,
        self.moves = 0  # rows moved to keep the used rows contiguous,
        self.reallocations = 0  # and times the copy grew

    def bytes_for(self, rows: int, capacity: int) -> int:
        per_token = self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * rows * capacity * per_token

    def invalidate(self) -> None:
        self._ids, self._lengths = [], []

    def release(self) -> None:
        self.invalidate()
        self._k = self._v = None

    def _reserve(self, rows: int, longest: int) -> bool:
        """Make room for ``rows`` rows of ``longest`` tokens, keeping the used rows; False if over budget."""
        have_rows, have_tokens = (0, 0) if self._k is None else (self._k.shape[1], self._k.shape[3])
        if rows <= have_rows and longest <= have_tokens:
            return True
        tokens = max(have_tokens, -(-longest // _CAPACITY_STEP) * _CAPACITY_STEP)
        want = max(rows, have_rows)
        if self.bytes_for(want, tokens) > self.budget_bytes:
            return False
        # grow rows geometrically while the budget allows it, so a growing batch reallocates rarely
        want = max(want, min(2 * have_rows, self.budget_bytes // max(1, self.bytes_for(1, tokens))))
        shape = (self.num_layers, want, self.num_kv_heads, tokens, self.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        used = len(self._ids)
        if used:
            k[:, :used, :, :have_tokens] = self._k[:, :used]
            v[:, :used, :, :have_tokens] = self._v[:, :used]
        self._k = self._v = None  # the old copy goes before the caller uses the new one
        self._k, self._v = k, v
        self.reallocations += 1
        return True

    def _evict_absent(self, wanted: set[str]) -> None:
        """Give up the rows of requests not decoding this step; the last used row fills each hole."""
        r = 0
        while r < len(self._ids):
            if self._ids[r] in wanted:
                r += 1
                continue
            last = len(self._ids) - 1
            if r != last:
                self._k[:, r] = self._k[:, last]
                self._v[:, r] = self._v[:, last]
                self._ids[r], self._lengths[r] = self._ids[last], self._lengths[last]
                self.moves += 1
            self._ids.pop()
            self._lengths.pop()

    def plan(self, ids: list[str], lengths: list[int], slots: torch.Tensor) -> DecodeKVStep | None:
        longest = max(lengths)
        self._evict_absent(set(ids))
        if not self._reserve(len(ids), longest):
            self.release()
            return None
        row_of = {rid: r for r, rid in enumerate(self._ids)}
        append_rows, append_at, append_from, fill_rows, fill_from = [], [], [], [], []
        for i, (rid, n) in enumerate(zip(ids, lengths)):
            r = row_of.get(rid)
            if r is None:  # joins: a new row at the end
                r = len(self._ids)
                self._ids.append(rid)
                self._lengths.append(0)
            if self._lengths[r] + 1 == n:
                append_rows.append(r)
                append_at.append(n - 1)
                append_from.append(i)
            else:  # new, or its KV changed since it last decoded: fill it from the paged cache
                fill_rows.append(r)
                fill_from.append(i)
            self._lengths[r] = n
        position = {rid: i for i, rid in enumerate(ids)}
        order = [position[rid] for rid in self._ids]  # the used rows are exactly this step's requests
        self.appends += len(append_rows)
        self.rebuilds += len(fill_rows)
        tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        identity = order == list(range(len(ids)))
        step = DecodeKVStep(self._k, self._v, len(ids), longest, None if identity else tensor(order),
                            None, None, None, None, None)
        if append_rows:
            step.append_rows, step.append_at = tensor(append_rows), tensor(append_at)
            if append_from != list(range(len(ids))):
                step.append_from = tensor(append_from)
        if fill_rows:
            fill_length = max(lengths[i] for i in fill_from)
            step.fill_rows = tensor(fill_rows)
            step.fill_slots = slots[fill_from, :fill_length].to(self.device)
        return step
