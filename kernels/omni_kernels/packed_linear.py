"""Linear layers on weights prepacked once for oneDNN: the AR decoders' matrix products at decode batch sizes.

Contract: ``pack_linears(module, batch_hint, plain_max_rows=0)`` replaces every ``torch.nn.Linear`` inside ``module``
whose weight is a CPU float32/bfloat16 tensor with a ``PackedLinear`` that computes ``reference_linear`` (``F.linear``)
on a copy of the weight reordered once into oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight``,
the reorder PyTorch's own CPU compiler applies to frozen weights); it returns how many it replaced. Outputs equal
``F.linear`` to float rounding, for any number of rows and leading dimensions; the original weight is released
(kept only with ``plain_max_rows``, below). Modules on other devices or dtypes, and modules of a dtype whose prepacked
product this CPU lacks (``omni_kernels.capability.packing_supported``: bfloat16 needs AVX-512 or AVX-NE-CONVERT; no
dtype without oneDNN), are left as they are and run ``F.linear``; which path each dtype took is recorded
(``capability.record_path("linear.<dtype>", ...)``, logged once). ``PackedLinear`` itself refuses such a weight with
a ``ValueError`` that says why.
``PackedLinear(linear, batch_hint, activation="gelu_tanh")`` computes ``reference_linear_gelu`` (tanh-GELU of the
output) with the activation fused into oneDNN's product: applied to the float32 accumulator before rounding, so in
bfloat16 it is closer to the float32 result than the two ops in sequence, and it costs one pass instead of two
(``python benchmarks/tools/kernels_bench.py``, 480 rows, 256 -> 512, one thread: 341 us fused against 651 us for
``F.linear`` then ``F.gelu`` in bfloat16, 882 against 1273 us in float32).
``plain_max_rows=n`` (float32, no activation) keeps the row-major weight too and computes calls of at most ``n`` rows
with ``F.linear`` on it: for one or two rows MKL's matrix-vector path beats the blocked product
(``python benchmarks/tools/kernels_bench.py --threads 1``: 1.44x on the thinker's MLP at one row, 1.71x on the talker's at
two; from 4 rows on the blocked product wins), at the price of a second copy of the weight. In bfloat16 the blocked
product is faster at every row count, so the option is ignored there.

Why: ``F.linear`` on CPU multiplies by a row-major weight that MKL repacks on every call; a decode step calls
each projection with a handful of rows, where that repacking is a large share of the call. Measured on this CPU,
one thread (``python benchmarks/tools/kernels_bench.py``): 1.3x faster at 32 rows of a 512x1536 projection, 1.4-1.6x
at 2-8 rows, 1.14x at 256 rows (a prefill chunk).

Why module replacement and not a subclass or a patched ``nn.Linear.forward``: the decoder's own code calls
``self.q_proj(x)``; swapping the child module is the narrowest change that reaches it (as quantization tools
do), and it touches only the modules handed in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omni_kernels.capability import (dtype_name, packing_available, packing_supported, packing_unsupported_reason,
                                     record_path)

_DTYPES = (torch.float32, torch.bfloat16)
PACKED_PATH = "prepacked oneDNN product"
PLAIN_PATH = "F.linear (plain library product)"


def record_linear_path(dtype: torch.dtype) -> bool:
    """Record (and log once) whether linear layers of ``dtype`` run prepacked here; returns that answer."""
    supported = packing_supported(dtype)
    record_path(f"linear.{dtype_name(dtype)}", PACKED_PATH if supported else PLAIN_PATH,
                None if supported else packing_unsupported_reason(dtype))
    return supported


_ACTIVATIONS = {None: ("none", ""), "gelu_tanh": ("gelu", "tanh")}


class PackedLinear(torch.nn.Module):
    """``linear``'s forward on its weight prepacked for ``batch_hint`` rows (a layout hint; any row count works),
    followed by ``activation`` (None or ``"gelu_tanh"``), fused."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int, activation: str | None = None,
                 plain_max_rows: int = 0):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"PackedLinear activation {activation!r} is not one of {sorted(map(str, _ACTIVATIONS))}")
        self.activation = activation
        self._attr, self._algorithm = _ACTIVATIONS[activation]
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        if not packing_supported(weight.dtype):
            raise ValueError(f"PackedLinear cannot prepack a {weight.dtype} weight here: "
                             f"{packing_unsupported_reason(weight.dtype)}; use the plain nn.Linear")
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint),
                             persistent=False)
        self.bias = linear.bias
        keep_plain = plain_max_rows > 0 and activation is None and weight.dtype == torch.float32
        self.plain_max_rows = plain_max_rows if keep_plain else 0
        self.register_buffer("plain_weight", weight if keep_plain else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain_max_rows and x.numel() <= self.plain_max_rows * self.in_features:
            return F.linear(x, self.plain_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, self._attr, [], self._algorithm)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (f", activation={self.activation}" if self.activation else "")
                + (f", plain_max_rows={self.plain_max_rows}" if self.plain_max_rows else ""))


def _packable(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is torch.nn.Linear and isinstance(w, torch.Tensor) and w.device.type == "cpu"
            and w.dtype in _DTYPES and (module.bias is None or module.bias.dtype == w.dtype))


def pack_linears(module: torch.nn.Module, batch_hint: int = 32, plain_max_rows: int = 0) -> int:
    targets = [(parent, name, child) for parent in module.modules()
               for name, child in parent.named_children() if _packable(child)]
    supported = {dtype: record_linear_path(dtype) for dtype in {child.weight.dtype for _, _, child in targets}}
    targets = [t for t in targets if supported[t[2].weight.dtype]]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, batch_hint, plain_max_rows=plain_max_rows))
    return len(targets)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def reference_linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")
