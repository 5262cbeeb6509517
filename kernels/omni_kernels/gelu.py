"""The tanh-approximated GELU, computed over cache-sized row chunks: the DiTs' feed-forward activation on CPU.

Contract: ``tanh_gelu(x)`` equals ``reference_tanh_gelu(x)`` (``F.gelu(x, approximate="tanh")``) for float32 and
bfloat16 inputs of any shape, to float rounding: it computes in float32 and returns ``x``'s dtype (bit-identical to
``F.gelu`` in bfloat16 on the measured data, within an ulp in float32). Off the CPU it is ``reference_tanh_gelu``.

Why: ATen's CPU tanh-GELU kernel costs ~2 ns per element, five times its own ``tanh``; composing it from vectorised
in-place ops on row chunks that stay in L2 is ~30% faster, and GELU is 15-20% of a DiT forward on this CPU (the
Qwen-Image transformer's MLPs; the Qwen2.5-Omni code2wav DiT fuses its GELU into the product instead,
``PackedLinear(activation="gelu_tanh")``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_K = math.sqrt(2.0 / math.pi)
_CHUNK = 65536  # elements per chunk (256 KiB of float32: stays in L2; measured best)


def reference_tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":  # the chunking is a CPU cache trick: on accelerators the fused kernel is the fast one
        return reference_tanh_gelu(x)
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    rows = max(1, _CHUNK // flat.shape[1])
    for i in range(0, flat.shape[0], rows):
        xf = flat[i:i + rows].float()
        u = xf * xf
        u.mul_(0.044715 * _K).add_(_K).mul_(xf).tanh_().add_(1.0).mul_(xf).mul_(0.5)
        out[i:i + rows] = u
    return out.view(x.shape)
