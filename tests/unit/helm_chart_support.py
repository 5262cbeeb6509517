"""Shared by the Helm chart tests: the values cases and accessors of a render (fixtures: tests/unit/conftest.py)."""

from __future__ import annotations

import importlib
import importlib.util
import os

import yaml

from omni_serve.graph.registry import families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "helm", "omni-serve")
CRD_SCHEMA = os.path.join(ROOT, "tests", "data", "kuberay", "rayservice.v1.schema.json")
SPECS = {name: family.spec for name, family in families().items()}
MiB = 1 << 20


def _load_values(name: str) -> dict:
    with open(os.path.join(CHART, name)) as f:
        return yaml.safe_load(f) or {}


def _load_render_script():
    spec = importlib.util.spec_from_file_location("render_k8s", os.path.join(ROOT, "scripts", "render_k8s.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Values sets rendered by the structural tests: the defaults, the two shipped examples, and two layouts the
# examples do not cover (the Qwen-Image graph; the disaggregated Omni thinker with a hostPath checkpoint).
CASES = {
    "default": {},
    "cpu-demo": _load_values("values-cpu-demo.yaml"),
    "gpu-prod": _load_values("values-gpu.yaml"),
    "qwen-image": {
        "graph": {"name": "qwen_image"},
        "args": {"default_steps": 8, "edges": {"dit_vae": {"connector": "shm"}}},
        "stages": {"text_encoder": {"resources": {"omni_cpu": 1}}, "dit": {"num_cpus": 1, "resources": {"omni_cpu": 1}},
                   "vae": {"resources": {"omni_cpu": 1}}},
        "workerGroups": [{"name": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                          "rayResources": {"omni_cpu": 100},
                          "resources": {"limits": {"cpu": "4", "memory": "8Gi"}}}],
    },
    "omni-disagg": {
        "checkpoint": {"hostPath": "/data/models", "subPath": "qwen2_5_omni-small", "generate": {"enabled": False}},
        "args": {"thinker_layout": "disaggregated",
                 "edges": {"thinker_prefill_thinker_decode": {"connector": "mooncake"}}},
        "stages": {"thinker_prefill": {"num_cpus": 1, "resources": {"omni_prefill": 1}},
                   "thinker_decode": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}},
        "workerGroups": [{"name": "prefill", "minReplicas": 0, "maxReplicas": 2, "rayResources": {"omni_prefill": 10},
                          "idleTimeoutSeconds": 300, "resources": {"limits": {"cpu": "2", "memory": "8Gi"}}}],
        "rayAutoscaler": {"enabled": True, "options": {"version": "v2", "idleTimeoutSeconds": 120}},
        # Options the examples leave at their defaults, for the CRD check.
        "ray": {"authOptions": {"mode": "token", "secretName": "omni-ray-token"}},
        "apiKey": {"existingSecret": "omni-api-key"},
        "head": {"nodeSelector": {"pool": "cpu"}, "podAnnotations": {"example.com/a": "b"},
                 "rayStartParams": {"num-cpus": 2}, "rayClient": {"enabled": True}},
        "networkPolicy": {"serveFrom": [{"namespaceSelector": {"matchLabels": {
                              "kubernetes.io/metadata.name": "ingress"}}}],
                          "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [{"port": 443}]}]},
        "serveService": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
        "image": {"pullSecrets": [{"name": "regcred"}], "pullPolicy": "Always"},
        "serviceAccountName": "omni-serve",
        "podSecurityContext": {"fsGroup": 1000},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "ingress": {"enabled": True, "className": "nginx"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    },
    "wan-jobs": {  # a job API on two ingress replicas: a shared results volume and PostgreSQL from a Secret
        "graph": {"name": "wan"},
        "args": {"ingress": {"num_replicas": 2}, "default_steps": 30, "jobs": {"result_ttl_s": 86400}},
        "jobs": {"existingClaim": "video-jobs", "subPath": "wan", "databaseUrlSecret": {"name": "video-jobs-db"}},
        "workerGroups": [{"name": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                          "resources": {"limits": {"cpu": "4", "memory": "8Gi"}}}],
    },
}
EXAMPLES = ["default", "cpu-demo", "gpu-prod"]


# The chart refuses to render without an API key unless told the API may be open; values that say nothing about
# `apiKey` are rendered with this Secret (the tests of the refusal call ``chart.render`` themselves).
KEYED = {"apiKey": {"existingSecret": "omni-api-key"}}


def keyed(values: dict) -> dict:
    return values if "apiKey" in values else {**values, **KEYED}


def _render(chart, values: dict, release: str = "omni") -> dict[str, list[dict]]:
    """{template path: [parsed objects]} of a render (NOTES.txt left out); ``keyed`` values."""
    rendered = chart.render(keyed(values), name=release, namespace="omni", is_install=True)
    return {path: [doc for doc in yaml.safe_load_all(text) if doc]
            for path, text in rendered.items() if not path.endswith("NOTES.txt")}


def _objects(render: dict[str, list[dict]]) -> list[dict]:
    return [doc for docs in render.values() for doc in docs]


def _rayservice(render) -> dict:
    (rs,) = [o for o in _objects(render) if o["kind"] == "RayService"]
    return rs


def _serve_config(render) -> dict:
    return yaml.safe_load(_rayservice(render)["spec"]["serveConfigV2"])


def _app(render) -> dict:
    (app,) = _serve_config(render)["applications"]
    return app


def _graph_spec(render):
    app = _app(render)
    graph = app["import_path"].partition(":")[0].rsplit(".", 1)[-1]
    return SPECS[graph].model_validate(app["args"])


def _deployed(spec) -> list[str]:
    """Stages build_app deploys for the spec's layout (its family's graph declaration)."""
    (family,) = [f for f in families().values() if type(spec) is f.spec]
    return [s.name for s in family.graph.deployed(spec.layout())]


def _groups(rs: dict) -> list[dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    return [{**cluster["headGroupSpec"], "groupName": "head"}, *cluster.get("workerGroupSpecs", [])]


def _ray_containers(rs: dict) -> list[dict]:
    return [group["template"]["spec"]["containers"][0] for group in _groups(rs)]


def _network_policy(render) -> dict | None:
    policies = [o for o in _objects(render) if o["kind"] == "NetworkPolicy"]
    assert len(policies) <= 1, policies
    return policies[0] if policies else None


def _notes(chart, values: dict, release: str = "omni") -> str:
    return chart.render(keyed(values), name=release, namespace="omni", is_install=True)["omni-serve/templates/NOTES.txt"]
