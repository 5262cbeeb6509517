"""What this CPU (and this torch build) can run: the one place every bfloat16 or prepacked path asks.

Contract:
- ``cpu_capability()`` describes the process' CPU once (cached): ATen's vector dispatch level (``isa``: ``AVX2``,
  ``AVX512``, ...; ``ATEN_CPU_CAPABILITY`` lowers it), the bfloat16/AMX instruction sets the hardware reports, and
  whether oneDNN's prepacked linear product (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``,
  what ``omni_kernels.PackedLinear`` runs) works in float32 and in bfloat16, each with the reason when it does not.
- ``bfloat16_slow_reason()``: None where bfloat16 products run faster than float32 (the CPU has native bfloat16
  dot products, AVX512-BF16 or AMX, and oneDNN's prepacked bfloat16 product works), else why not: what a setting
  of ``auto`` precision asks before it picks bfloat16.
- ``packing_supported(dtype)`` / ``packing_unsupported_reason(dtype)``: that answer for one dtype. A caller that
  would prepack a weight of an unsupported dtype takes the library's plain path instead (``F.linear``, which torch
  runs in every dtype on every x86-64 CPU, only slower where oneDNN lacks the instructions).
- ``record_path(what, path, reason)`` notes which implementation a component runs (logged once per component and
  path, at INFO for the fast path and WARNING for a fallback); ``kernel_paths()`` returns every note of this
  process. Stage replicas report them in their stats (``ready()["kernels"]``, the ingress' ``/health``) and the
  bench report copies them, so numbers from AVX2, AVX-512 and AMX machines are never compared blind.

How the answer is found: oneDNN's own query (``torch.ops.mkldnn._is_mkldnn_bf16_supported``: AVX-512 BW/VL/DQ or
AVX-NE-CONVERT; it honours ``ONEDNN_MAX_CPU_ISA``), then a probe: a tiny weight is packed and multiplied and the
result compared with ``F.linear``. The probe catches what a flag query cannot (a build without the ops, a kernel
that raises or computes wrong on this CPU). Why a probe of our own and not only the query: the query exists only
for bfloat16, and an error inside the first real product would crash a replica instead of choosing its path.

``ONEDNN_MAX_CPU_ISA=AVX2`` (read by oneDNN once, at its first use) makes an AVX-512 machine answer as an AVX2-only
one does; the tests use it to run the fallback paths on every machine.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_PROBE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class CpuCapability:
    """What the process' CPU runs (see the module docstring). ``packed`` maps a dtype name to whether the prepacked
    product works in it; ``unsupported`` maps the dtypes where it does not to the reason."""

    isa: str
    cpu_name: str
    avx512_bf16: bool
    amx: bool
    onednn_bf16: bool
    onednn_max_cpu_isa: str | None
    packed: dict[str, bool] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def _flag(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:  # a private query that a torch build lacks or cannot answer means "not known to be there"
        return False


def packing_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear ops at all (``packing_supported(dtype)`` says whether
    they run in a dtype on this CPU)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight")


def _onednn_bf16() -> bool:
    query = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:
        return False


def _probe(dtype: torch.dtype, onednn_bf16: bool) -> str | None:
    """None if the prepacked product works in ``dtype`` here, else why not."""
    if not packing_available():
        return "this torch build has no oneDNN linear ops"
    if dtype == torch.bfloat16 and not onednn_bf16:
        return ("oneDNN has no bfloat16 product on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT"
                + (f"; ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}" if "ONEDNN_MAX_CPU_ISA" in os.environ
                   else "") + "): bfloat16 products run on ATen's generic kernels, several times slower than "
                "float32 here; prefer float32 on this CPU")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 8, generator=g).to(dtype)
    x = torch.randn(3, 8, generator=g).to(dtype)
    try:
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 4), None, "none",
                                                 [], "")
    except RuntimeError as exc:
        return f"oneDNN's prepacked product raised: {str(exc).splitlines()[0]}"
    want = F.linear(x.float(), w.float())
    if not torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2):
        return "oneDNN's prepacked product disagreed with F.linear on a probe"
    return None


@functools.lru_cache(maxsize=1)
def cpu_capability() -> CpuCapability:
    onednn_bf16 = _onednn_bf16()
    reasons = {name: _probe(dtype, onednn_bf16) for name, dtype in _PROBE_DTYPES.items()}
    try:
        cpu_name = str(torch.cpu.get_capabilities().get("cpu_name", ""))
    except Exception:
        cpu_name = ""
    return CpuCapability(
        isa=torch.backends.cpu.get_cpu_capability(), cpu_name=cpu_name,
        avx512_bf16=_flag("_is_avx512_bf16_supported"), amx=_flag("_is_amx_tile_supported"),
        onednn_bf16=onednn_bf16, onednn_max_cpu_isa=os.environ.get("ONEDNN_MAX_CPU_ISA"),
        packed={name: why is None for name, why in reasons.items()},
        unsupported={name: why for name, why in reasons.items() if why is not None})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def packing_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear product runs in ``dtype`` on this CPU."""
    return cpu_capability().packed.get(dtype_name(dtype), False)


def packing_unsupported_reason(dtype: torch.dtype) -> str | None:
    """Why the prepacked product does not run in ``dtype`` here (None where it does)."""
    name = dtype_name(dtype)
    if name not in _PROBE_DTYPES:
        return f"prepacked products are float32/bfloat16 only, not {name}"
    return cpu_capability().unsupported.get(name)


_paths: dict[str, dict[str, str]] = {}
_paths_lock = threading.Lock()


def bfloat16_slow_reason() -> str | None:
    """None where bfloat16 products beat float32 on this CPU; else why they do not. Measured (docs/benchmarks.md):
    with AVX512-BF16 the prepacked bfloat16 DiT is 1.35-1.46x float32's speed, with AMX more; where oneDNN
    emulates bfloat16 or has no product for it, float32 is as fast or several times faster."""
    cpu = cpu_capability()
    why = cpu.unsupported.get("bfloat16")
    if why:
        return why
    if not (cpu.avx512_bf16 or cpu.amx):
        return "the CPU has no native bfloat16 dot product (AVX512-BF16 or AMX): float32 is as fast here"
    return None


def record_path(what: str, path: str, reason: str | None = None) -> None:
    """Note that ``what`` (a component, e.g. ``"linear.bfloat16"``: the process' bfloat16 linear layers) runs
    ``path``, and why when it is a fallback; logged the first time a component takes a path."""
    entry = {"path": path, **({"reason": reason} if reason else {})}
    with _paths_lock:
        if _paths.get(what) == entry:
            return
        _paths[what] = entry
    if reason:
        log.warning("%s: %s (%s)", what, path, reason)
    else:
        log.info("%s: %s", what, path)


def kernel_paths() -> dict[str, dict[str, str]]:
    """Every ``record_path`` note of this process: component -> {"path", and "reason" for a fallback}."""
    with _paths_lock:
        return {k: dict(v) for k, v in _paths.items()}
