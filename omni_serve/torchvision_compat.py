"""Let torchvision import beside the CPU build of torch (transformers' image and video processors need it).

Why: the PyPI torchvision wheel that matches torch 2.13.0 is a CUDA build; its ``_C.so`` needs ``libtorch_cuda``
and cannot load beside the CPU torch, and torchvision then fails at import (``operator torchvision::nms does not
exist``: its fake-kernel registrations need the schemas ``_C.so`` would define). Nothing omni_serve runs calls
torchvision's compiled ops (the processors' resizing and normalisation are plain torch ops), so
``TorchvisionOpsHook`` defines the two schemas torchvision registers fakes for (``nms``, ``qnms``) just before
torchvision is first imported, *only* when ``_C.so`` fails to load. Where the ops load (a GPU machine) it does
nothing.

transformers imports torchvision from many places and Ray starts fresh interpreters, so the hook is installed in
every interpreter of an environment by a one-line ``.pth`` file (``python -m omni_serve.torchvision_compat``,
run by ``make setup`` and ``make vllm-env``); ``install_hook()`` installs it in the running interpreter
(idempotent; a no-op once torchvision is imported).
"""

from __future__ import annotations

import glob
import importlib.abc
import importlib.util
import os
import sys

PTH_NAME = "omni_serve_torchvision_compat.pth"
# Guarded so the interpreter still starts (e.g. pip) where omni_serve is not importable yet.
PTH_LINE = ("import importlib.util as _u; _u.find_spec('omni_serve') and "
            "__import__('omni_serve.torchvision_compat').torchvision_compat.install_hook()\n")

_KEEP: list = []  # the Library objects must outlive the process' use of the schemas


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
    _KEEP.append(lib)


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


if __name__ == "__main__":  # python -m omni_serve.torchvision_compat: install the .pth hook
    print(install_pth())
