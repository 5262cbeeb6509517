"""Paged attention for transformers decoder layers, registered as attention implementation ``omni_paged``.

Contract: a model whose config has ``_attn_implementation = "omni_paged"`` is called on one *packed* batch
(``inputs_embeds`` of shape ``[1, T, H]``: the new tokens of every scheduled request back to back) with
``omni_batch=PagedBatch(...)`` as an extra forward kwarg, which transformers passes through to every
attention call, and ``attention_mask={"full_attention": None}`` so the model builds no mask of its own.
Per layer, ``paged_attention`` writes the new keys/values into their cache slots, then attends each
request's queries to that request's cached keys (causal within the new tokens):
- decode requests (one new token each) in one padded ``omni_kernels.decode_attention`` call over their KV (a
  sequence's result does not depend on its batch partners or their order, to the bit): a contiguous copy kept
  from step to step, one row per request in the copy's own row order (``omni_serve.engines.ar.decode_kv``),
  when the engine gives one, else gathered per layer;
- each prefill chunk in its own SDPA call (``is_causal`` when the chunk starts the sequence, else an
  explicit mask that lets query ``i`` see cache slots ``<= past + i``).
Gather indices and masks are built once per step in ``PagedBatch`` and reused by every layer.

Why not transformers' ``paged|sdpa`` path: it expects the continuous-batching manager's packed kwargs
(cu_seq_lens, read/write index per allocator) built from its own request states; this module takes only
block tables, which is what the Omni stages (embedding inputs, M-RoPE positions) need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from omni_kernels import decode_attention, decode_bias
from transformers import AttentionInterface

from omni_serve.engines.ar.decode_kv import DecodeKV, DecodeKVStep
from omni_serve.engines.ar.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "omni_paged"


@dataclass
class PrefillSegment:
    start: int  # first row of the segment in the packed batch
    length: int  # new tokens
    read_slots: torch.Tensor  # [past + length] cache rows
    mask: torch.Tensor | None  # [length, past + length] bool; None when past == 0 (plain causal)


@dataclass
class PagedBatch:
    cache: PagedKVCache
    write_slots: torch.Tensor  # [T] cache rows of the new tokens
    decode_rows: torch.Tensor | None = None  # [B] packed rows of single-token requests
    decode_slots: torch.Tensor | None = None  # [B, L] cache rows (padded)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, L] additive (0 / -inf), None if no padding
    decode_kv: DecodeKVStep | None = None  # the decode rows' contiguous KV copy (None: gather per layer)
    decode_kv_rows: torch.Tensor | None = None  # [B] packed rows in the copy's row order
    decode_kv_mask: torch.Tensor | None = None  # [B, 1, 1, L] decode_mask in the copy's row order
    prefills: list[PrefillSegment] = field(default_factory=list)
    segments: list | None = None  # what ``build`` was given (tensor-parallel ranks rebuild the batch from it)

    @classmethod
    def build(cls, cache: PagedKVCache, segments: list[tuple[str, int, torch.Tensor, torch.Tensor]],
              decode_kv: DecodeKV | None = None) -> "PagedBatch":
        """``segments``: per request, in packed order, (request id, new tokens n, write slots [n], read slots
        [past+n]). With ``decode_kv``, decode rows attend over its contiguous copy when it fits its budget. The
        indices and masks are built on the host (the block tables live there) and moved to the cache's device
        once, here."""
        device = cache.k.device
        writes, prefills, d_rows, d_slots, d_ids = [], [], [], [], []
        row = 0
        for rid, n, write, read in segments:
            writes.append(write)
            if n == 1:
                d_rows.append(row)
                d_slots.append(read)
                d_ids.append(rid)
            else:
                past = read.numel() - n
                mask = None
                if past:
                    mask = (torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]).to(device)
                prefills.append(PrefillSegment(row, n, read.to(device), mask))
            row += n
        batch = cls(cache, torch.cat(writes).to(device), prefills=prefills, segments=segments)
        if d_rows:
            lengths = [s.numel() for s in d_slots]
            longest = max(lengths)
            slots = torch.zeros(len(d_slots), longest, dtype=torch.long)
            for i, s in enumerate(d_slots):
                slots[i, :s.numel()] = s
            slots = slots.to(device)
            batch.decode_rows = torch.tensor(d_rows, device=device)
            batch.decode_slots = slots
            if min(lengths) != longest:
                batch.decode_mask = decode_bias(torch.tensor(lengths), longest).to(device)
            if decode_kv is not None:
                batch.decode_kv = decode_kv.plan(d_ids, lengths, slots)
                batch.decode_kv_rows, batch.decode_kv_mask = batch.decode_rows, batch.decode_mask
                order = batch.decode_kv.order if batch.decode_kv is not None else None
                if order is not None:  # the copy's rows are in its own order: queries and mask follow it
                    batch.decode_kv_rows = batch.decode_rows[order]
                    if batch.decode_mask is not None:
                        batch.decode_kv_mask = batch.decode_mask[order]
        elif decode_kv is not None:
            decode_kv.invalidate()
        return batch


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query ``[1, heads, T, d]``, key/value ``[1, kv_heads, T, d]`` -> (``[1, T, heads, d]``, None)."""
    batch: PagedBatch | None = kwargs.get("omni_batch")
    if batch is None:
        raise RuntimeError("omni_paged attention needs the engine's omni_batch kwarg; use the AR engine")
    k_cache, v_cache = batch.cache.k[module.layer_idx], batch.cache.v[module.layer_idx]
    k_cache.index_copy_(0, batch.write_slots, key[0].transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(0, batch.write_slots, value[0].transpose(0, 1).to(v_cache.dtype))
    q = query[0]  # [heads, T, d]
    out = query.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, heads, d]
    gqa = q.shape[0] != k_cache.shape[1]
    if batch.decode_rows is not None:
        rows, mask = batch.decode_rows, batch.decode_mask
        if batch.decode_kv is not None:
            kd, vd = batch.decode_kv.keys_values(  # [B, kv_heads, L, d] views of the contiguous copy
                module.layer_idx, k_cache, v_cache, key[0][:, rows].transpose(0, 1),
                value[0][:, rows].transpose(0, 1))
            rows, mask = batch.decode_kv_rows, batch.decode_kv_mask  # the copy's row order
        else:
            kd = k_cache[batch.decode_slots].transpose(1, 2).contiguous()  # [B, kv_heads, L, d]
            vd = v_cache[batch.decode_slots].transpose(1, 2).contiguous()
        out[rows] = decode_attention(q[:, rows].transpose(0, 1), kd, vd, mask, scaling)  # [B, heads, d]
    for seg in batch.prefills:
        qp = q[:, seg.start:seg.start + seg.length].unsqueeze(0)
        kp = k_cache[seg.read_slots].transpose(0, 1).unsqueeze(0)
        vp = v_cache[seg.read_slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=seg.mask, is_causal=seg.mask is None,
                                           scale=scaling, enable_gqa=gqa)
        out[seg.start:seg.start + seg.length] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
