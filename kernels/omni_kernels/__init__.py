"""omni_serve's own kernels: the top-level ``kernels/`` folder, imported as ``omni_kernels``.

Each kernel is a function with a pure-torch reference beside it (``reference_*``) that states what it computes;
``tests/unit/test_kernels.py`` holds every kernel to its reference, and a kernel is used only where it pays in a
served benchmark (docs/benchmarks.md says which). Kernels here run on whatever device their inputs are on;
accelerator-only versions (Triton) get modules of their own and tests marked ``gpu``.

Why ``omni_kernels`` and not ``kernels``: that import name belongs to Hugging Face's kernel hub package, which
transformers probes for; ours must not shadow it.
"""

from omni_kernels.capability import (bfloat16_slow_reason, cpu_capability, kernel_paths, packing_available,
                                     packing_supported, packing_unsupported_reason, record_path)
from omni_kernels.decode_attention import decode_attention, decode_bias, reference_decode_attention
from omni_kernels.gelu import reference_tanh_gelu, tanh_gelu
from omni_kernels.packed_linear import (PackedLinear, pack_linears, record_linear_path, reference_linear,
                                        reference_linear_gelu)

__all__ = ["PackedLinear", "bfloat16_slow_reason", "cpu_capability", "decode_attention", "decode_bias",
           "kernel_paths", "pack_linears", "packing_available", "packing_supported", "packing_unsupported_reason",
           "record_linear_path", "record_path", "reference_decode_attention", "reference_linear",
           "reference_linear_gelu", "reference_tanh_gelu", "tanh_gelu"]
