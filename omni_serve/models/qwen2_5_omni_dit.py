"""One transformer block of Qwen2.5-Omni's code2wav DiT, computed from transformers' own submodules, with less
work than ``DiTDecoderLayer.forward`` does on CPU.

Contract: ``dit_block(layer, hidden, time_emb, rope, block_size)`` returns what ``layer(hidden, time_emb,
position_embeddings=rope, block_diff=...)`` returns for the DiT's block mask (the same math; floating-point
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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from omni_kernels import tanh_gelu
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf

def own_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention of ``[B, H, L, D]`` queries to the keys of their own block of ``block_size`` frames only."""
    b, h, length, d = q.shape
    n = -(-length // block_size)
    pad = n * block_size - length

    def blocks(x):
        return F.pad(x, (0, 0, 0, pad)).view(b, h, n, block_size, d)

    scores = torch.matmul(blocks(q), blocks(k).transpose(-1, -2)) * (1.0 / math.sqrt(d))
    if pad:  # the last block's padding keys
        scores[:, :, -1, :, block_size - pad:] = float("-inf")
    probs = scores.float().softmax(-1).to(q.dtype)
    return torch.matmul(probs, blocks(v)).view(b, h, n * block_size, d)[:, :, :length]


def _attention(attn, x: torch.Tensor, rope, block_size: int, back: int, ahead: int) -> torch.Tensor:
    b = x.shape[0]
    heads = attn.heads
    q, k, v = (proj(x).view(b, -1, heads, attn.inner_dim // heads).transpose(1, 2)
               for proj in (attn.to_q, attn.to_k, attn.to_v))
    cos, sin = rope  # as transformers: RoPE on the first head only, interleaved layout
    q[:, :1], k[:, :1] = hf.apply_rotary_pos_emb(hf.deinterleave_head_dim(q[:, :1]),
                                                 hf.deinterleave_head_dim(k[:, :1]), cos, sin)
    if back == 0 and ahead == 0:
        out = own_block_attention(q, k, v, block_size)
    else:
        block = torch.arange(x.shape[1], device=x.device) // block_size
        diff = block.view(1, -1) - block.view(-1, 1)
        mask = ((diff >= -back) & (diff <= ahead)).view(1, 1, *diff.shape)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
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


def dit_block(layer, hidden: torch.Tensor, time_emb: torch.Tensor, rope, block_size: int) -> torch.Tensor:
    """One ``DiTDecoderLayer`` (eval mode: dropout is the identity) on ``hidden [B, frames, C]``."""
    norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = layer.attn_norm(hidden, emb=time_emb)
    attended = _attention(layer.attn, norm, rope, block_size, layer.look_backward_block, layer.look_ahead_block)
    hidden = hidden + gate_msa.unsqueeze(1) * attended
    norm = layer.ff_norm(hidden) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    up, down = layer.ff.ff[0], layer.ff.ff[3]
    return hidden + gate_mlp.unsqueeze(1) * down(tanh_gelu(up(norm)))
