"""What the lent GPU machine has, and a dry run that sees only that.

Contract:
* ``image_packages()``: the distributions on the GPU machines' image (``scripts/gpu_image_packages.txt``).
* ``carried_closure(roots)``: the wheels ``make gpu-wheels`` carries there: ``roots`` and every distribution they
  need on that machine's Python (3.12, Linux x86-64), at this venv's versions, less ``NEVER_CARRIED`` (torch,
  numpy and triton: the machine's own builds stay). ``scripts/gpu_check.sh`` installs them with pip resolving against what the image has, so a
  missing or too old dependency is taken from the carried wheels or fails the install at once.
* ``shadow_site(folder)``: a folder of links to this venv's files of only those distributions (image and carried);
  ``shadow_python(folder, module)`` the command that runs a module under ``python -S`` with that folder as its only site:
  the check's dry run on CPU then imports what the GPU machine would import, and a module that imports anything
  else (FastAPI, Ray, PyAV) fails in ``make test``.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IMAGE_PACKAGES = os.path.join(REPO, "scripts", "gpu_image_packages.txt")
# What the GPU check imports beyond torch; ``make gpu-wheels`` carries them and what they need.
CARRIED_ROOTS = ("transformers", "tokenizers", "huggingface_hub", "safetensors", "diffusers", "cache_dit",
                 "pydantic", "pydantic_core", "typing_inspection", "annotated_types", "soundfile")
# The machine's own builds, never carried (a CPU wheel would replace its CUDA torch), and Pillow (any version does).
NEVER_CARRIED = {"torch", "numpy", "triton", "pillow"}
# The GPU machine's interpreter and platform, for evaluating requirement markers.
MACHINE = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
           "sys_platform": "linux", "platform_system": "Linux", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    with open(IMAGE_PACKAGES) as f:
        return {normalize(line.strip()) for line in f if line.strip() and not line.startswith("#")}


def carried_closure(roots=CARRIED_ROOTS) -> dict[str, str]:
    """``{distribution: version}`` of ``roots`` and their requirements on the GPU machine, from this venv."""
    from packaging.requirements import Requirement

    seen: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = normalize(todo.pop())
        if name in seen or name in NEVER_CARRIED:
            continue
        dist = metadata.distribution(name)
        seen[name] = dist.version
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(MACHINE):
                todo.append(req.name)
    return dict(sorted(seen.items()))


def shadow_site(folder: str) -> list[str]:
    """Link into ``folder`` the top-level files of every installed distribution that the GPU machine has (its image
    or the carried wheels); returns the distributions linked."""
    allowed = image_packages() | set(carried_closure())
    linked = []
    os.makedirs(folder, exist_ok=True)
    for dist in metadata.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name not in allowed or not dist.files:
            continue
        tops = {str(path).split("/", 1)[0] for path in dist.files}
        for top in tops:
            source = os.path.realpath(os.path.join(str(dist.locate_file("")), top))
            target = os.path.join(folder, top)
            if top in ("..", "") or top.endswith(".pth") or not os.path.exists(source) or os.path.lexists(target):
                continue
            os.symlink(source, target)
        linked.append(name)
    # This venv's own fix that lets PyPI's CUDA torchvision import beside the CPU torch (a GPU machine's torchvision
    # matches its torch and needs none).
    from omni_serve.torchvision_compat import PTH_LINE, PTH_NAME

    with open(os.path.join(folder, PTH_NAME), "w") as f:
        f.write(PTH_LINE)
    return sorted(linked)


def shadow_python(folder: str, module: str) -> list[str]:
    """The command (arguments to append) that runs ``python -m module`` with ``folder`` as the only site: no
    site-packages of this venv, the ``.pth`` files in ``folder`` processed."""
    import sys

    boot = ("import runpy, site, sys; site.addsitedir(sys.argv.pop(1)); sys.argv[0] = sys.argv.pop(1); "
            "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
    return [sys.executable, "-S", "-c", boot, folder, module]


# pip's platform tags for a manylinux wheel: pip matches each glibc version exactly, so name the usual ones.
_PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
              "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64",
              "linux_x86_64"]


def download_wheels(folder: str) -> int:
    """``make gpu-wheels``: the carried closure's wheels for the GPU machine's Python into ``folder``, with
    ``requirements.txt`` (the roots, pinned: what gpu_check.sh installs) beside them."""
    import subprocess
    import sys

    os.makedirs(folder, exist_ok=True)
    closure = carried_closure()
    with open(os.path.join(folder, "requirements.txt"), "w") as f:
        f.writelines(f"{name}=={closure[normalize(name)]}\n" for name in CARRIED_ROOTS)
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", folder,
           "--python-version", MACHINE["python_version"], "--implementation", "cp",
           *[arg for tag in _PLATFORMS for arg in ("--platform", tag)],
           *[f"{name}=={version}" for name, version in closure.items()]]
    print(f"downloading {len(closure)} wheels for CPython {MACHINE['python_version']} into {folder}/", flush=True)
    return subprocess.call(cmd)


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "download":
        sys.exit("usage: python -m omni_serve.bench.gpu_env download DIR")
    sys.exit(download_wheels(sys.argv[2]))
