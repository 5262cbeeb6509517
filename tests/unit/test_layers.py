"""The package's layers hold: no lower layer imports an upper one, and the ingress process loads no model code.

Layers, top to bottom (a module may import its own layer and any layer below; function-level imports count):
tools (cli, bench) > checkpoint writers > families (``omni_serve.graph.<family>``) > deployments > the generic
graph framework (``omni_serve.graph.*`` modules) > model adapters > engines, parallel > metrics, autoscaling,
realtime admission > api, transport, jobs, request ids, playback, realtime projection > settings, torchvision_compat.
Inside a family, only ``replica/`` (what stage replicas run) may import the family's replica code; everything else of
the family is ingress-side or declaration.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "omni_serve")

RANKS = {
    "cli": 10, "bench": 10,
    "checkpoints": 9,
    "families": 8,
    "kits": 7,
    "deployments": 6,
    "graph": 5,
    "models": 4,
    "engines": 3, "parallel": 3,
    "metrics": 2, "autoscaling": 2, "realtime_admission": 2,
    "api": 1, "transport": 1, "jobs": 1, "request_ids": 1, "playback": 1, "realtime_projection": 1,
    "settings": 0, "torchvision_compat": 0, "omni_serve": 0,
}


def _layer(module: str) -> str:
    parts = module.split(".")
    return "omni_serve" if len(parts) == 1 else parts[1]


def _package(module: str) -> str | None:
    """The family or kit ``module`` belongs to (``families.qwen_image``, ``kits.diffusion``), else None."""
    parts = module.split(".")
    return ".".join(parts[1:3]) if len(parts) > 2 and parts[1] in ("families", "kits") else None


def _modules() -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("omni_serve"):
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if f"{node.module}.{a.name}" in _modules()]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("omni_serve")]
    return found


def test_every_top_level_module_has_a_layer():
    tops = {m.split(".")[1] for m in _modules() if "." in m}
    assert tops <= set(RANKS), f"give these a layer in RANKS: {tops - set(RANKS)}"


def test_no_lower_layer_imports_an_upper_one():
    bad = []
    for module, path in _modules().items():
        src = _layer(module)
        for line, target in _imports(path):
            dst = _layer(target)
            if RANKS[dst] > RANKS[src]:
                bad.append(f"{module}:{line} ({src}) imports {target} ({dst})")
    assert not bad, "\n".join(bad)


def test_no_family_imports_another_family_and_no_kit_another_kit():
    bad = []
    for module, path in _modules().items():
        own = _package(module)
        if own is None:
            continue
        for line, target in _imports(path):
            other = _package(target)
            if other is not None and other != own and _layer(target) == _layer(module):
                bad.append(f"{module}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_only_replica_code_imports_replica_code():
    bad = []
    for module, path in _modules().items():
        if _package(module) is None or ".replica" in module:
            continue
        bad += [f"{module}:{line} imports {t}" for line, t in _imports(path) if ".replica" in t]
    assert not bad, "\n".join(bad)


# The ingress process: the ingress deployment's module and every family's frontend, built on the family's tiny
# checkpoint. What it must not load: the families' replica code, the model adapters their stages name, the
# engines, and the model code of transformers/diffusers (an architecture's modeling module; transformers' auto
# mappings are names only).
INGRESS_PROBE = r"""
import json, sys
from omni_serve.deployments import ingress
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.registry import families, import_path

checkpoints = json.loads(sys.argv[1])
adapters = set()
for name, family in families().items():
    spec = family.validate({"checkpoint": checkpoints[name]})
    stages = StageCalls(family.graph, spec, open_call=None, probe=None)
    import_path(family.frontend)(spec, stages)
    adapters |= {s.adapter.partition(":")[0] for s in family.graph.stages}
print(json.dumps({"modules": sorted(sys.modules), "adapters": sorted(adapters)}))
"""


def _forbidden(module: str, adapters: set[str]) -> bool:
    parts = module.split(".")
    return (module in adapters
            or (_package(module) is not None and ".replica" in module)
            or (module.startswith("omni_serve.engines.") and module not in (
                "omni_serve.engines.ar", "omni_serve.engines.ar.config",  # settings only (pydantic)
                "omni_serve.engines.vllm_engine", "omni_serve.engines.vllm_engine.config"))
            or (parts[0] == "transformers" and len(parts) > 3 and parts[1] == "models" and parts[2] != "auto"
                and parts[3].startswith("modeling_"))
            or (parts[0] == "diffusers" and len(parts) > 2 and parts[1] == "models"
                and parts[2] in ("transformers", "autoencoders", "unets")))


def test_the_ingress_process_loads_no_model_code(omni_tiny_dir, qwen_image_tiny_dir):
    from omni_serve.graph.registry import families

    checkpoints = {"qwen2_5_omni": omni_tiny_dir, "qwen_image": qwen_image_tiny_dir}
    checkpoints.update({name: _tiny(name) for name in families() if name not in checkpoints})
    out = subprocess.run([sys.executable, "-c", INGRESS_PROBE, json.dumps(checkpoints)], capture_output=True,
                         text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    loaded = [m for m in probe["modules"] if _forbidden(m, set(probe["adapters"]))]
    assert not loaded, f"the ingress process loaded model code: {loaded}"
    assert not any(m.startswith("omni_serve.models.") and m in probe["adapters"] for m in probe["modules"])


def _tiny(name: str) -> str:
    """The tiny checkpoint of another registered family (written once, like the session's own)."""
    from tests.conftest import tiny_checkpoint

    return tiny_checkpoint(name)


@pytest.mark.parametrize("module", ["omni_serve.graph.spec", "omni_serve.graph.registry", "omni_serve.cli"])
def test_specs_registry_and_cli_load_without_torch(module):
    code = f"import sys, {module}; from omni_serve.graph.registry import families; families(); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
