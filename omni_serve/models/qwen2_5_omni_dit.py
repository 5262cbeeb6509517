"""One transformer block of Qwen2.5-Omni's code2wav DiT, computed from transformers' own submodules, with less
work than ``DiTDecoderLayer.forward`` does on CPU.

Contract: ``dit_block(layer, hidden, time_emb, rope, pack)`` returns, on each window of ``pack``, what
``layer(hidden, time_emb, position_embeddings=rope, block_diff=...)`` returns on that window alone for the DiT's block mask (the same math; floating-point
results agree to rounding, checked against transformers' whole-sequence token2wav by the oracle tests). It
reads the layer's weights and its ``look_backward_block`` / ``look_ahead_block``; nothing is copied.

Why not call the layer: two of its ops cost far more than they need to on this CPU (py-spy and torch's
profiler on the served bf16 DiT: attention 22% and GELU 19% of its time):
- attention is computed densely over the window with a block mask; a layer that sees only its own block
  (most layers: neither look-back nor look-ahead) is computed block by block instead, as batched matrix
  products over ``[blocks, block_size, block_size]`` scores (2x less time at 240 frames, and linear instead
  of quadratic in the window). Layers with a neighbour block keep the masked dense call: measured, a
  windowed version is no faster at these sizes.
- ATen's CPU tanh-GELU kernel costs ~2 ns per element, five times its own ``tanh``: ``omni_kernels.tanh_gelu``
  computes it ~30% faster (bit-identical to ``F.gelu`` in bfloat16 on the measured data, within an ulp in float32).

Windows of different lengths share one call (``WindowPack``): every op of the block but attention works frame by
frame, so windows are laid end to end along the frame axis, each padded to whole blocks; attention stays inside
each window (own-block layers mask the padding keys; neighbour-block layers take each run of equally long windows
as one batch of its windows' real frames). Each window's frames get what a call on that window alone gives them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omni_kernels import tanh_gelu
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf


@dataclass(frozen=True)
class WindowPack:
    """Windows of ``lengths`` frames laid end to end, each padded to a whole number of ``block_size`` blocks."""

    lengths: tuple[int, ...]
    block_size: int
    device: torch.device | str = "cpu"

    def padded(self, n: int) -> int:
        return -(-n // self.block_size) * self.block_size

    @functools.cached_property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(start, real frames) of each window in the packed axis."""
        out, start = [], 0
        for n in self.lengths:
            out.append((start, n))
            start += self.padded(n)
        return tuple(out)

    @property
    def total(self) -> int:
        start, n = self.spans[-1]
        return start + self.padded(n)

    @functools.cached_property
    def runs(self) -> tuple[tuple[int, int, int, int], ...]:
        """(start, windows, padded length, real frames) of each run of consecutive equally long windows."""
        out = []
        for start, n in self.spans:
            if out and out[-1][3] == n:
                first, count, padded, _ = out[-1]
                out[-1] = (first, count + 1, padded, n)
            else:
                out.append((start, 1, self.padded(n), n))
        return tuple(out)

    @functools.cached_property
    def key_valid(self) -> torch.Tensor | None:
        """``[total]`` True on real frames; None when no window has padding."""
        if all(self.padded(n) == n for n in self.lengths):
            return None
        valid = torch.zeros(self.total, dtype=torch.bool, device=self.device)
        for start, n in self.spans:
            valid[start:start + n] = True
        return valid

    def positions(self) -> torch.Tensor:
        """``[1, total]``: each frame's position within its own window (RoPE is per window)."""
        return torch.cat([torch.arange(self.padded(n), device=self.device) for n in self.lengths]).view(1, -1)

    def pack(self, per_window: list[torch.Tensor]) -> torch.Tensor:
        """``[..., frames_i, C]`` per window -> ``[..., total, C]``, zeros on the padding."""
        first = per_window[0]
        out = first.new_zeros(*first.shape[:-2], self.total, first.shape[-1])
        for (start, n), x in zip(self.spans, per_window):
            out[..., start:start + n, :] = x
        return out

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """``[..., total, C]`` -> each window's ``[..., frames_i, C]`` (views)."""
        return [packed[..., start:start + n, :] for start, n in self.spans]


def own_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: WindowPack) -> torch.Tensor:
    """Attention of ``[B, H, pack.total, D]`` queries to the keys of their own block only (padding keys excluded)."""
    b, h, length, d = q.shape
    n, size = length // pack.block_size, pack.block_size

    def blocks(x):
        return x.reshape(b, h, n, size, d)

    scores = torch.matmul(blocks(q), blocks(k).transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if pack.key_valid is not None:
        scores.masked_fill_(~pack.key_valid.view(1, 1, n, 1, size), float("-inf"))
    probs = scores.float().softmax(-1).to(q.dtype)
    return torch.matmul(probs, blocks(v)).view(b, h, length, d)


@functools.lru_cache(maxsize=64)
def _neighbour_mask(length: int, block_size: int, back: int, ahead: int, device) -> torch.Tensor:
    block = torch.arange(length, device=device) // block_size
    diff = block.view(1, -1) - block.view(-1, 1)
    return ((diff >= -back) & (diff <= ahead)).view(1, 1, length, length)


def neighbour_block_attention(q, k, v, back: int, ahead: int, pack: WindowPack) -> torch.Tensor:
    """Attention to the keys of the own block, ``back`` blocks before and ``ahead`` after, within each window."""
    b, h, _, d = q.shape
    out = torch.zeros_like(q)  # the padding frames' output is never read (see WindowPack)
    for start, count, padded, n in pack.runs:  # equally long windows: one call, each window a batch row
        span = slice(start, start + count * padded)

        def rows(x):  # [b, h, count * padded, d] -> [b * count, h, n, d], the windows' real frames
            return x[:, :, span].unflatten(2, (count, padded))[:, :, :, :n].transpose(1, 2).reshape(-1, h, n, d)
        mask = _neighbour_mask(n, pack.block_size, back, ahead, q.device)
        att = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=mask)
        out[:, :, span].unflatten(2, (count, padded))[:, :, :, :n] = att.view(b, count, h, n, d).transpose(1, 2)
    return out


def _attention(attn, x: torch.Tensor, rope, back: int, ahead: int, pack: WindowPack) -> torch.Tensor:
    b = x.shape[0]
    heads = attn.heads
    q, k, v = (proj(x).view(b, -1, heads, attn.inner_dim // heads).transpose(1, 2)
               for proj in (attn.to_q, attn.to_k, attn.to_v))
    cos, sin = rope  # as transformers: RoPE on the first head only, interleaved layout
    q[:, :1], k[:, :1] = hf.apply_rotary_pos_emb(hf.deinterleave_head_dim(q[:, :1]),
                                                 hf.deinterleave_head_dim(k[:, :1]), cos, sin)
    if back == 0 and ahead == 0:
        out = own_block_attention(q, k, v, pack)
    else:
        out = neighbour_block_attention(q, k, v, back, ahead, pack)
    return attn.to_out[0](out.transpose(1, 2).reshape(b, -1, attn.inner_dim))


def check_dit_block(layer) -> None:
    """Refuse a DiT layer whose structure ``dit_block`` does not reproduce (a changed transformers version)."""
    ff = getattr(getattr(layer, "ff", None), "ff", None)
    if (ff is None or len(ff) != 4 or not isinstance(ff[1], torch.nn.GELU) or ff[1].approximate != "tanh"
            or not all(hasattr(layer, a) for a in ("attn_norm", "attn", "ff_norm", "look_backward_block",
                                                  "look_ahead_block"))):
        raise TypeError(f"{type(layer).__name__} is not the DiT block omni_serve's code2wav reproduces "
                        "(Linear, tanh-GELU, Dropout, Linear feed-forward with block-masked attention); "
                        "check the installed transformers version")


def dit_block(layer, hidden: torch.Tensor, time_emb: torch.Tensor, rope, pack: WindowPack) -> torch.Tensor:
    """One ``DiTDecoderLayer`` (eval mode: dropout is the identity) on ``hidden [B, pack.total, C]``: the windows
    of ``pack`` end to end in each row."""
    norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = layer.attn_norm(hidden, emb=time_emb)
    attended = _attention(layer.attn, norm, rope, layer.look_backward_block, layer.look_ahead_block, pack)
    hidden = hidden + gate_msa.unsqueeze(1) * attended
    norm = layer.ff_norm(hidden) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    up, down = layer.ff.ff[0], layer.ff.ff[3]
    return hidden + gate_mlp.unsqueeze(1) * down(tanh_gelu(up(norm)))
