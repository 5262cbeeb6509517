"""Paged KV cache: one preallocated slab of fixed-size blocks and the allocator that hands them out.

Contract:
- ``PagedKVCache(layers, kv_heads, head_dim, num_blocks, block_size, dtype, device)`` holds ``k``/``v`` as
  ``[layers, num_blocks * block_size, kv_heads, head_dim]``; token slot ``s`` of a request lives at row
  ``block_table[s // block_size] * block_size + s % block_size``. Allocated once, never grows: memory is
  bounded by configuration, whatever the load.
- ``BlockAllocator`` owns which request holds which blocks. ``allocate(rid, num_tokens)`` grows a request's
  table to cover ``num_tokens`` slots, all or nothing; ``free(rid)`` returns its blocks. Blocks are
  reference counted so identical prompt prefixes share them: ``register(rid, i, h)`` records the content
  hash of a request's full block ``i`` once computed, ``match_prefix(rid, hashes)`` adopts already-computed
  blocks for a new request. A freed block keeps its hash and content until it is reallocated
  (least-recently freed first), so a repeated prefix hits even after its first request ended.
- Counters: ``num_used_blocks`` (held by live requests), ``num_free_blocks`` (includes evictable cached ones).

Why our own and not transformers' ``PagedAttentionCache``: that one is welded to its ``RequestState`` and
scheduler (sectors, ledgers, CB-only kwargs); the Omni stages need block tables for requests fed by
input embeddings with multimodal positions, and a prefix key that covers media content.

Thread safety: every method takes the allocator's lock; the engine calls it from its worker thread, abort
paths from the event loop.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


def block_hashes(keys: list, block_size: int) -> list[int]:
    """Chained content hashes of the full blocks of ``keys`` (one hashable key per token)."""
    out, parent = [], None
    for i in range(len(keys) // block_size):
        parent = hash((parent, tuple(keys[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of: dict[int, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self.prefix_hits = 0  # tokens served from cached blocks (for metrics)

    # -- counters -----------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, rid: str) -> list[int]:
        with self._lock:
            return list(self._tables.get(rid, ()))

    def holds(self, rid: str) -> bool:
        with self._lock:
            return bool(self._tables.get(rid))

    # -- allocation ---------------------------------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self._ref[block] == 0:
            del self._free[block]
        self._ref[block] += 1

    def allocate(self, rid: str, num_tokens: int) -> bool:
        """Grow ``rid``'s table to cover ``num_tokens`` slots; False (nothing taken) if blocks run out."""
        with self._lock:
            table = self._tables.setdefault(rid, [])
            need = self.blocks_for(num_tokens) - len(table)
            if need <= 0:
                return True
            if need > len(self._free):
                if not table:
                    del self._tables[rid]
                return False
            for _ in range(need):
                block, _ = self._free.popitem(last=False)  # least recently freed first
                old = self._hash_of.pop(block, None)
                if old is not None:
                    self._block_of.pop(old, None)
                self._ref[block] = 1
                table.append(block)
            return True

    def free(self, rid: str) -> None:
        with self._lock:
            for block in reversed(self._tables.pop(rid, ())):
                self._ref[block] -= 1
                if self._ref[block] == 0:
                    self._free[block] = None

    # -- prefix sharing -----------------------------------------------------------------------------------
    def match_prefix(self, rid: str, hashes: list[int]) -> int:
        """Adopt the cached blocks of the longest matching prefix; returns the number of tokens covered."""
        with self._lock:
            if self._tables.get(rid):
                return 0
            matched = []
            for h in hashes:
                block = self._block_of.get(h)
                if block is None:
                    break
                matched.append(block)
            for block in matched:
                self._take(block)
            if matched:
                self._tables[rid] = matched
            tokens = len(matched) * self.block_size
            self.prefix_hits += tokens
            return tokens

    def register(self, rid: str, index: int, h: int) -> None:
        """Record that block ``index`` of ``rid`` is full and holds the prefix with chained hash ``h``."""
        with self._lock:
            table = self._tables.get(rid)
            if table is None or index >= len(table) or h in self._block_of:
                return
            block = table[index]
            if block in self._hash_of:
                return
            self._hash_of[block] = h
            self._block_of[h] = block

    # -- slot indices -------------------------------------------------------------------------------------
    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        """Cache rows of token slots ``[start, end)`` of ``rid`` (its table must cover them)."""
        with self._lock:
            table = torch.tensor(self._tables[rid], dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
