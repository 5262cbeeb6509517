"""Grouped-query attention of one new query per sequence over that sequence's keys: the decode step's attention.

Contract: ``decode_attention(q [B, H, d], k [B, KVH, L, d], v [B, KVH, L, d], bias, scale) -> [B, H, d]``, where
``H`` is a multiple of ``KVH`` and query head ``h`` reads key/value head ``h // (H // KVH)`` (transformers' GQA
layout, ``repeat_kv``); ``bias`` is ``decode_bias(lengths, L)`` (``[B, 1, 1, L]``: 0 where a key is attended,
-inf past the sequence's length) or None when every sequence has ``L`` keys. It equals
``reference_decode_attention`` (``F.scaled_dot_product_attention`` with ``enable_gqa``) to float rounding, and
each sequence's result depends only on its own inputs: the same bits whatever the batch's order or other
members (SDPA's CPU kernel does not promise that: permuting its batch moves results by ~1e-7).

Why not SDPA itself: with one query row per sequence SDPA's CPU kernel pays per-call setup for tiles sized for
long queries, and its GQA path expands the keys per query head. Here each key/value head is read once, by one
batched matrix product for all of its query heads (a group's query heads become the rows of a ``[g, d]``
matrix), and the softmax runs over ``[B, KVH, g, L]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_bias(lengths: torch.Tensor, length: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The additive mask for sequences of ``lengths`` keys padded to ``length``: ``[B, 1, 1, length]``."""
    keep = torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]
    bias = torch.zeros(keep.shape, dtype=dtype, device=lengths.device).masked_fill_(~keep, float("-inf"))
    return bias.view(len(lengths), 1, 1, length)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads})")
    scale = dim ** -0.5 if scale is None else scale
    queries = (q * scale).view(batch, kv_heads, heads // kv_heads, dim).to(k.dtype)
    scores = torch.matmul(queries, k.transpose(-1, -2))  # [B, KVH, g, L]
    if bias is not None:
        scores += bias.to(scores.dtype)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).view(batch, heads, dim).to(q.dtype)


def reference_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
                               scale: float | None = None) -> torch.Tensor:
    mask = None if bias is None else bias == 0
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0]
