"""Qwen2.5-Omni's code2wav DiT (its transformer blocks and output head) computed from transformers' own weights,
with less work per ODE evaluation than calling ``DiTDecoderLayer`` does on CPU.

Contract: ``PreparedDiT(dit, dtype)`` is built once per model; ``blocks(hidden, time, rope, pack)`` returns,
on each window of ``pack``, what the DiT's layers return on that window alone for its block mask, and ``head``
what ``norm_out`` + ``proj_out`` return (the same math in eval mode; floating-point results agree to rounding,
checked against transformers' whole-sequence token2wav by the oracle tests). The blocks' weights are copied in
``dtype`` (prepacked, fused); ``dit``'s own modules are left as they are.

Why not call the layers: per-op cost dominates at these sizes (a 240-frame window is 480 rows of 256 features on
the small checkpoint, 36 evaluations per solve), and several ops cost far more than they need to on CPU
(docs/prepared.md has the gain over transformers' layers, measured by
``benchmarks/qwen2_5_omni/code2wav_solve_times.py``):
- the time conditioning depends on the ODE time only and is computed once per time value;
- linear layers run on weights prepacked for oneDNN, q/k/v in one product, tanh-GELU fused into the MLP's first
  product (``omni_kernels.PackedLinear(activation="gelu_tanh")``: 1.9x faster than the two ops in bfloat16);
- RoPE's ``rotate_half`` comes out of the q/k product (extra rows), attention's 1/sqrt(d) is folded into q when
  it is a power of two (exact), modulations are layer norm's own affine, gated residuals single ``addcmul`` ops;
- attention to the own block only (most layers) runs block by block, as batched matrix products over
  ``[blocks, block_size, block_size]`` scores (2x less time than the masked dense call at 240 frames, and linear
  instead of quadratic in the window). Layers with a neighbour block keep the masked dense call: measured, a
  windowed version is no faster at these sizes in bfloat16.

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

from omni_serve.models.loading import linear_from


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


def own_block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pack: WindowPack,
                        scale: float) -> torch.Tensor:
    """Attention of ``[B, H, pack.total, D]`` queries to the keys of their own block only (padding keys excluded);
    ``scale`` multiplies the scores (1.0 when q carries it)."""
    b, h, length, d = q.shape
    n, size = length // pack.block_size, pack.block_size

    def blocks(x):
        return x.reshape(b, h, n, size, d)

    scores = torch.matmul(blocks(q), blocks(k).transpose(-1, -2))
    if scale != 1.0:
        scores *= scale
    if pack.key_valid is not None:
        scores.masked_fill_(~pack.key_valid.view(1, 1, n, 1, size), float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, blocks(v)).view(b, h, length, d)


@functools.lru_cache(maxsize=64)
def _neighbour_mask(length: int, block_size: int, back: int, ahead: int, device) -> torch.Tensor:
    block = torch.arange(length, device=device) // block_size
    diff = block.view(1, -1) - block.view(-1, 1)
    return ((diff >= -back) & (diff <= ahead)).view(1, 1, length, length)


def neighbour_block_attention(q, k, v, back: int, ahead: int, pack: WindowPack, scale: float) -> torch.Tensor:
    """Attention to the keys of the own block, ``back`` blocks before and ``ahead`` after, within each window."""
    b, h, _, d = q.shape
    out = torch.zeros_like(q)  # the padding frames' output is never read (see WindowPack)
    for start, count, padded, n in pack.runs:  # equally long windows: one call, each window a batch row
        span = slice(start, start + count * padded)

        def rows(x):  # [b, h, count * padded, d] -> [b * count, h, n, d], the windows' real frames
            return x[:, :, span].unflatten(2, (count, padded))[:, :, :, :n].transpose(1, 2).reshape(-1, h, n, d)
        mask = _neighbour_mask(n, pack.block_size, back, ahead, q.device)
        att = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=mask, scale=scale)
        out[:, :, span].unflatten(2, (count, padded))[:, :, :, :n] = att.view(b, count, h, n, d).transpose(1, 2)
    return out


def check_dit_block(layer) -> None:
    """Refuse a DiT layer whose structure ``PreparedDiT`` does not reproduce (a changed transformers version)."""
    ff = getattr(getattr(layer, "ff", None), "ff", None)
    if (ff is None or len(ff) != 4 or not isinstance(ff[1], torch.nn.GELU) or ff[1].approximate != "tanh"
            or not all(hasattr(layer, a) for a in ("attn_norm", "attn", "ff_norm", "look_backward_block",
                                                  "look_ahead_block"))):
        raise TypeError(f"{type(layer).__name__} is not the DiT block omni_serve's code2wav reproduces "
                        "(Linear, tanh-GELU, Dropout, Linear feed-forward with block-masked attention); "
                        "check the installed transformers version")




@dataclass(frozen=True)
class _Block:
    """One ``DiTDecoderLayer``'s weights as ``PreparedDiT`` runs them."""

    qkv: torch.nn.Module  # [q | k | v | rotate_half(q head 0) | rotate_half(k head 0)] in one product (see _prepare)
    out: torch.nn.Module
    up_gelu: torch.nn.Module  # the MLP's first linear layer with its tanh-GELU
    down: torch.nn.Module
    modulation: torch.nn.Module  # the AdaLayerNormZero's linear (time embedding -> 6 modulation vectors)
    heads: int
    inner: int  # heads * head_dim (q, k and v each)
    back: int
    ahead: int
    scale: float  # attention's 1/sqrt(head_dim) where it is not already folded into q (1.0 when it is)
    attn_eps: float
    ff_eps: float


@dataclass(frozen=True)
class _TimeConditioning:
    """Everything an ODE evaluation derives from its time alone (the same for every window and call)."""

    blocks: tuple[tuple[torch.Tensor, ...], ...]  # per block: shift, 1 + scale, gate (attention); the same (MLP)
    out_scale: torch.Tensor  # 1 + the output norm's scale, float32 [dim]
    out_shift: torch.Tensor


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
            activation: str | None = None) -> torch.nn.Module:
    """A linear layer on its own ``dtype`` copy of ``weight``, prepacked for oneDNN where this CPU runs that product
    in ``dtype`` (``omni_kernels.packing_supported``; the path taken is recorded in the stage's stats), else the
    plain library layers; ``activation="gelu_tanh"`` applies tanh-GELU to its output (fused into the product when
    prepacked)."""
    from omni_kernels import PackedLinear, record_linear_path

    lin = linear_from(weight, bias, dtype)
    if weight.device.type == "cpu" and record_linear_path(dtype):
        return PackedLinear(lin, batch_hint=256, activation=activation)
    return lin if activation is None else torch.nn.Sequential(lin, torch.nn.GELU(approximate="tanh"))


def _qk_rows(weight: torch.Tensor, head_dim: int, scale: float) -> torch.Tensor:
    """A q or k projection's rows (weight or bias): head 0 reordered as transformers' ``deinterleave_head_dim``
    leaves it, the other heads, then ``rotate_half`` of head 0's rows (negating a row is exact), all times ``scale``."""
    head0 = torch.cat([weight[:head_dim:2], weight[1:head_dim:2]])
    half = head_dim // 2
    return torch.cat([head0, weight[head_dim:], -head0[half:], head0[:half]]) * scale


class PreparedDiT:
    """Qwen2.5-Omni's code2wav DiT blocks and output head, prepared once for ``OmniCode2Wav.dit_windows``.

    Contract: ``blocks(hidden, time, rope, pack)`` is the DiT's transformer blocks on ``hidden [2, pack.total, dim]``
    (the conditional and unconditional rows; each window of ``pack`` as if alone) at ODE time ``time``, and
    ``head(hidden, time)`` its ``norm_out`` + ``proj_out`` in float32. ``rope(cos, sin)`` converts the DiT's rotary
    embedding once per call. The math is ``DiTDecoderLayer.forward``'s in eval mode (dropout is the identity):
    outputs agree with it to float rounding (the oracle tests compare with transformers' whole-sequence token2wav).

    The time conditioning (time embedding, each block's modulation vectors, the output norm's) depends only on the
    ODE time, the same in every solve with the same steps: it is computed once per time value and kept. The module
    docstring lists the other savings.
    The blocks run in ``dtype`` (float32 as transformers, or bfloat16) on copies of ``dit``'s weights; ``dit`` itself
    is left as it is (transformers' own path keeps using it).
    """

    @staticmethod
    def supports(dit) -> bool:
        """Whether every transformer block of ``dit`` has the structure this class reproduces."""
        try:
            for layer in dit.transformer_blocks:
                check_dit_block(layer)
        except TypeError:
            return False
        return True

    def __init__(self, dit, dtype: torch.dtype):
        for layer in dit.transformer_blocks:
            check_dit_block(layer)
        self.dtype = dtype
        self._time_embed, self._norm_out = dit.time_embed, dit.norm_out
        self._proj_out = _linear(dit.proj_out.weight.detach(), dit.proj_out.bias, torch.float32)
        self.layers = tuple(self._prepare(layer, dtype) for layer in dit.transformer_blocks)
        self._times: dict[float, _TimeConditioning] = {}

    @staticmethod
    def _prepare(layer, dtype: torch.dtype) -> _Block:
        attn = layer.attn
        inner, head_dim = attn.inner_dim, attn.inner_dim // attn.heads
        # Attention's 1/sqrt(head_dim) goes into q's rows when it is a power of two (64 -> 1/8): scaling by a
        # power of two is exact, so the scores are the same numbers; otherwise it multiplies the scores.
        scale = 1.0 / math.sqrt(head_dim)
        fold = math.log2(scale).is_integer()
        q_scale = scale if fold else 1.0
        rows = {}
        for part in ("weight", "bias"):
            q = _qk_rows(getattr(attn.to_q, part).detach(), head_dim, q_scale)
            k = _qk_rows(getattr(attn.to_k, part).detach(), head_dim, 1.0)
            rows[part] = torch.cat([q[:inner], k[:inner], getattr(attn.to_v, part).detach(), q[inner:], k[inner:]])
        up, down, modulation = layer.ff.ff[0], layer.ff.ff[3], layer.attn_norm.linear
        return _Block(qkv=_linear(rows["weight"], rows["bias"], dtype),
                      out=_linear(attn.to_out[0].weight.detach(), attn.to_out[0].bias, dtype),
                      up_gelu=_linear(up.weight.detach(), up.bias, dtype, activation="gelu_tanh"),
                      down=_linear(down.weight.detach(), down.bias, dtype),
                      modulation=linear_from(modulation.weight, modulation.bias, dtype),
                      heads=attn.heads, inner=inner, back=layer.look_backward_block, ahead=layer.look_ahead_block,
                      scale=1.0 if fold else scale, attn_eps=layer.attn_norm.norm.eps, ff_eps=layer.ff_norm.eps)

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, total, head_dim]`` cos/sin -> ``[1, 1, total, head_dim]`` in the blocks' dtype."""
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    def _conditioning(self, time: torch.Tensor) -> _TimeConditioning:
        key = float(time)
        cond = self._times.get(key)
        if cond is None:
            # As transformers: the embedding of both CFG rows (the same time, so the same rows); the modulations
            # are then per feature, and row 0's serve both rows (layer norm's own affine weight and bias).
            emb = self._time_embed(time.reshape(1).repeat(2))
            low = torch.nn.functional.silu(emb.to(self.dtype))
            blocks = []
            for layer in self.layers:
                shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = torch.chunk(layer.modulation(low)[0], 6)
                blocks.append((shift, 1 + scale, gate, shift_mlp, 1 + scale_mlp, gate_mlp))
            scale, shift = torch.chunk(self._norm_out.linear(self._norm_out.silu(emb))[0], 2)
            cond = _TimeConditioning(tuple(blocks), 1 + scale, shift)
            if len(self._times) >= 4096:  # many distinct step schedules: start over rather than grow
                self._times.clear()
            self._times[key] = cond
        return cond

    def blocks(self, hidden: torch.Tensor, time: torch.Tensor, rope, pack: WindowPack) -> torch.Tensor:
        cond = self._conditioning(time)
        for layer, mods in zip(self.layers, cond.blocks):
            hidden = self._block(layer, mods, hidden, rope, pack)
        return hidden

    def head(self, hidden: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        cond = self._conditioning(time)
        norm = self._norm_out.norm
        return self._proj_out(F.layer_norm(hidden.float(), norm.normalized_shape, cond.out_scale, cond.out_shift,
                                           norm.eps))

    def _block(self, layer: _Block, mods, hidden: torch.Tensor, rope, pack: WindowPack) -> torch.Tensor:
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = mods
        dim = hidden.shape[-1]
        norm = F.layer_norm(hidden, (dim,), scale, shift, layer.attn_eps)
        hidden = torch.addcmul(hidden, gate, self._attention(layer, norm, rope, pack))
        norm = F.layer_norm(hidden, (dim,), scale_mlp, shift_mlp, layer.ff_eps)
        return torch.addcmul(hidden, gate_mlp, layer.down(layer.up_gelu(norm)))

    @staticmethod
    def _attention(layer: _Block, x: torch.Tensor, rope, pack: WindowPack) -> torch.Tensor:
        b, length, _ = x.shape
        heads, inner = layer.heads, layer.inner
        head_dim = inner // heads
        out = layer.qkv(x)
        # [3 (q, k, v), b, heads, length, head_dim] in one copy; then RoPE on head 0 of q and k (transformers
        # rotates the first head only): x * cos + rotate_half(x) * sin, rotate_half(x) computed by the product.
        qkv = out[..., :3 * inner].view(b, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4).contiguous()
        rotated = out[..., 3 * inner:].view(b, length, 2, head_dim).permute(2, 0, 1, 3)  # [2, b, length, hd]
        cos, sin = rope
        head0 = qkv[:2, :, 0]
        qkv[:2, :, 0] = torch.addcmul(head0 * cos, rotated, sin)
        q, k, v = qkv
        if layer.back == 0 and layer.ahead == 0:
            att = own_block_attention(q, k, v, pack, layer.scale)
        else:
            att = neighbour_block_attention(q, k, v, layer.back, layer.ahead, pack, layer.scale)
        return layer.out(att.transpose(1, 2).reshape(b, length, inner))


class LibraryDiT:
    """``PreparedDiT``'s interface over transformers' own modules: the fallback when the prepared blocks are off
    (``code2wav.params.prepared_dit: false``) or do not support the installed transformers' DiT.

    ``blocks`` runs ``DiTDecoderLayer.forward`` window by window (each with its own block mask, as the DiT's
    forward builds it), ``head`` the DiT's ``norm_out`` and ``proj_out``; everything in float32, as transformers
    runs token2wav. The prepared blocks are held to this path by ``tests/unit/test_code2wav_dit.py``.
    """

    dtype = torch.float32

    def __init__(self, dit):
        self.dit = dit

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos, sin

    def _time(self, time: torch.Tensor) -> torch.Tensor:
        return self.dit.time_embed(time.reshape(1).repeat(2))  # both CFG rows, as the DiT's forward

    def blocks(self, hidden: torch.Tensor, time: torch.Tensor, rope, pack: WindowPack) -> torch.Tensor:
        emb, (cos, sin), out = self._time(time), rope, torch.zeros_like(hidden)
        rows = hidden.shape[0]
        for start, n in pack.spans:
            h = hidden[:, start:start + n]
            position = (cos[:, start:start + n].expand(rows, -1, -1), sin[:, start:start + n].expand(rows, -1, -1))
            block_diff = self.dit._create_block_diff(h)
            for layer in self.dit.transformer_blocks:
                h = layer(h, emb, position_embeddings=position, block_diff=block_diff)
            out[:, start:start + n] = h
        return out

    def head(self, hidden: torch.Tensor, time: torch.Tensor) -> torch.Tensor:
        return self.dit.proj_out(self.dit.norm_out(hidden.float(), self._time(time)))
