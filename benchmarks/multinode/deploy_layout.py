"""Deploy a family's benchmark config on the multi-node harness in one of two layouts (benchmarks/multinode/run.sh).

    python benchmarks/multinode/deploy_layout.py FAMILY CONFIG.yaml spread|one-node

The harness' nodes carry ``omni_ingress`` (head), ``omni_a`` (worker1) and ``omni_b`` (worker2). ``spread`` is the
reference layout of docs/multinode.md (Omni: encoder and thinker on worker1, talker and code2wav on worker2;
images: the DiT on worker1, text encoder and VAE on worker2); ``one-node`` puts every stage on worker1. The
ingress is on the head in both. All nodes share this machine's cores, so the two differ in where data moves
(shared memory or Mooncake TCP between namespaces), not in compute.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPREAD = {
    "qwen2_5_omni": {"encoder": "omni_a", "thinker": "omni_a", "talker": "omni_b", "code2wav": "omni_b"},
    "qwen_image": {"dit": "omni_a", "text_encoder": "omni_b", "vae": "omni_b"},
}


def harness():
    spec = importlib.util.spec_from_file_location("multinode_cluster", os.path.join(ROOT, "scripts",
                                                                                     "multinode_cluster.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    family, config, layout = sys.argv[1:4]
    with open(config) as f:
        args = yaml.safe_load(f)
    args["checkpoint"] = os.path.abspath(args["checkpoint"])
    stages = args.setdefault("stages", {})
    for stage, resource in SPREAD[family].items():
        stages.setdefault(stage, {})["resources"] = {resource if layout == "spread" else "omni_a": 1}
    args.setdefault("ingress", {})["resources"] = {"omni_ingress": 1}
    h = harness()
    h.deploy(h.ClusterState.load(), sys.executable, family, args, family, "/")
    print(f"{family} deployed, layout {layout}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
