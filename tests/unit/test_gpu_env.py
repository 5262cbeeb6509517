"""What the GPU check carries to the lent machine and what its dry run lets import (omni_serve/bench/gpu_env.py)."""

from __future__ import annotations

import os
import subprocess

from omni_serve.bench.gpu_env import carried_closure, image_packages, shadow_python, shadow_site
from tests.conftest import REPO


def test_the_carried_wheels_close_over_what_the_roots_need_on_the_machine_but_never_its_torch():
    closure = carried_closure()
    assert {"transformers", "diffusers", "huggingface-hub", "soundfile"} <= set(closure)
    # what the roots need and the image lacks: the Hub's HTTP client, soundfile's cffi
    assert {"httpx2", "cffi", "pycparser"} <= set(closure)
    assert not {"torch", "numpy", "triton", "pillow"} & set(closure)
    assert all(version for version in closure.values())


def test_the_image_list_is_read_without_its_comments():
    packages = image_packages()
    assert {"torch", "numpy", "scipy", "pytest"} <= packages and not any(p.startswith("#") for p in packages)
    assert not {"ray", "fastapi", "vllm"} & packages


def test_the_dry_runs_site_holds_only_what_the_gpu_machine_has(tmp_path):
    site = str(tmp_path / "site")
    linked = shadow_site(site)
    names = set(os.listdir(site))
    assert {"torch", "transformers", "diffusers"} <= names and {"torch", "transformers"} <= set(linked)
    assert not {"ray", "fastapi", "starlette", "uvicorn", "av"} & names
    # the engines and the errors they raise import without a web framework; FastAPI itself does not import there
    code = ("import sys, omni_serve.api.errors, omni_serve.engines.ar.engine\n"
            "assert 'fastapi' not in sys.modules and 'ray' not in sys.modules, sorted(sys.modules)\n"
            "try:\n    import fastapi\nexcept ImportError:\n    print('no fastapi')\n")
    (tmp_path / "gpu_probe.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO, os.path.join(REPO, "kernels")])}
    proc = subprocess.run(shadow_python(site, "gpu_probe"), capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and "no fastapi" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
