"""The Helm chart (helm/omni-serve) and the plain manifests in k8s/ rendered from it.

Offline, no Ray cluster: the chart is linted and rendered with the Helm v4 SDK of ``helm-python-sdk``, then
the RayService is checked against KubeRay's v1.7.0 CRD schema (tests/data/kuberay), its serveConfigV2 against
Ray Serve's ServeDeploySchema, the application args against the graph's pydantic spec, each stage's
autoscaling_config against Ray's AutoscalingConfig, and the stage placement against the worker groups
(custom resources declared, GPUs where GPU stages land, enough capacity at max replicas, shm edges inside
one pod). Bad values must be rejected by the chart's values schema or its template checks. The security
defaults are checked too: Ray token auth, the NetworkPolicy, non-root pods without privileges (IPC_LOCK only
for RDMA groups) and the API key Secret.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import re

import helm_python
import jsonschema
import pytest
import yaml
from pydantic import ValidationError

from omni_serve import cli
from omni_serve.graph.registry import families
from omni_serve.families.qwen2_5_omni.spec import OmniGraphSpec
from omni_serve.graph.spec import StageSpec

from tests.unit.helm_chart_support import (
    keyed,
    CASES,
    CHART,
    CRD_SCHEMA,
    EXAMPLES,
    MiB,
    ROOT,
    SPECS,
    _app,
    _deployed,
    _graph_spec,
    _groups,
    _load_render_script,
    _network_policy,
    _notes,
    _objects,
    _ray_containers,
    _rayservice,
    _render,
    _serve_config,
)

# ---------------------------------------------------------------------------------------------- helm lint


@pytest.mark.parametrize("case", EXAMPLES)
def test_helm_lint_strict(case):
    report = helm_python.lint(CHART, values=keyed(CASES[case]), strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["total_charts_linted"] == 1
    assert not problems and not report["errors"], (problems, report["errors"])


# ------------------------------------------------------------------------------------ Kubernetes / KubeRay


def _crd_validator():
    with open(CRD_SCHEMA) as f:
        schema = json.load(f)["openAPIV3Schema"]
    return jsonschema.Draft7Validator(schema)


@pytest.mark.parametrize("case", list(CASES))
def test_rayservice_validates_against_kuberay_crd(renders, case):
    rs = _rayservice(renders[case])
    assert (rs["apiVersion"], rs["kind"]) == ("ray.io/v1", "RayService")
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in _crd_validator().iter_errors(rs)]
    assert not errors, errors
    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"


def test_crd_validator_catches_a_broken_rayservice(renders):
    """The CRD schema check can fail: a worker group without groupName, a non-string rayStartParam."""
    rs = copy.deepcopy(_rayservice(renders["cpu-demo"]))
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    del group["groupName"]
    group["rayStartParams"]["num-cpus"] = 2
    messages = [e.message for e in _crd_validator().iter_errors(rs)]
    assert any("groupName" in m for m in messages), messages
    assert any("is not of type 'string'" in m for m in messages), messages


DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@pytest.mark.parametrize("case", EXAMPLES)
def test_manifests_are_sane_kubernetes_objects(renders, case):
    objects = _objects(renders[case])
    assert objects
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind"), obj
        name = obj["metadata"]["name"]
        assert DNS_1123.match(name) and len(name) <= 63, name
        labels = obj["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                    "helm.sh/chart"):
            assert key in labels, (obj["kind"], key)
        for value in labels.values():
            assert len(value) <= 63 and LABEL_VALUE.match(value), value
    rs = _rayservice(renders[case])
    # KubeRay: a RayService name is a DNS-1035 label of at most 47 characters.
    assert DNS_1035.match(rs["metadata"]["name"]) and len(rs["metadata"]["name"]) <= 47
    for group in _groups(rs):
        assert DNS_1123.match(group["groupName"])
        container = group["template"]["spec"]["containers"][0]
        assert container["name"] in ("ray-head", "ray-worker")
        assert {p["name"] for p in container["ports"]} >= {"serve", "metrics"}


def test_long_release_names_are_truncated_for_kuberay(chart):
    rs = _rayservice(_render(chart, {}, release="a-very-long-release-name-for-the-omni-serve-chart-x"))
    assert len(rs["metadata"]["name"]) <= 47 and DNS_1035.match(rs["metadata"]["name"])


def test_gpu_example_ingress_and_monitors_point_at_kuberay_objects(renders):
    objects = {o["kind"]: o for o in _objects(renders["gpu-prod"])}
    rs = objects["RayService"]
    name = rs["metadata"]["name"]
    serve_svc = rs["spec"]["serveService"]["metadata"]["name"]
    assert serve_svc == f"{name}-serve-svc"  # KubeRay's default name, set explicitly
    assert objects["Ingress"]["apiVersion"] == "networking.k8s.io/v1"
    for rule in objects["Ingress"]["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            assert path["backend"]["service"] == {"name": serve_svc, "port": {"name": "serve"}}
    # The ServiceMonitor selects the labels KubeRay puts on a RayService's head Service.
    monitor = objects["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "ray.io/originated-from-crd": "RayService", "ray.io/originated-from-cr-name": name,
        "ray.io/node-type": "head"}
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    # The PodMonitor selects exactly the worker pods.
    selector = objects["PodMonitor"]["spec"]["selector"]["matchLabels"]
    for group in _groups(rs):
        labels = group["template"]["metadata"]["labels"]
        matches = all(labels.get(k) == v for k, v in selector.items())
        assert matches == (group["groupName"] != "head"), group["groupName"]
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    for group in _groups(rs):
        assert group["rayStartParams"]["metrics-export-port"] == "8080"


def test_default_values_render_only_the_rayservice_and_its_network_policy(renders):
    kinds = sorted(o["kind"] for o in _objects(renders["default"]))
    assert kinds == ["NetworkPolicy", "RayService"]
    assert "enableInTreeAutoscaling" not in _rayservice(renders["default"])["spec"]["rayClusterConfig"]


# ------------------------------------------------------------------------------ data plane: shm, env vars


def _quantity_mib(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", text)
    assert match, text
    return int(match.group(1)) * (1024 if match.group(2) == "Gi" else 1)


@pytest.mark.parametrize("case", EXAMPLES)
def test_every_ray_container_has_a_sized_dev_shm_and_the_omni_serve_env(renders, case):
    rs = _rayservice(renders[case])
    for group in _groups(rs):
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = volumes[mounts["/dev/shm"]]["emptyDir"]
        assert shm["medium"] == "Memory"
        size = _quantity_mib(shm["sizeLimit"]) * MiB
        env = {e["name"]: e.get("value") for e in container["env"]}
        pool = int(env["OMNI_SERVE_SHM_POOL_BYTES"])
        store = int(group["rayStartParams"]["object-store-memory"])
        assert env["OMNI_SERVE_SHM_DIR"] == "/dev/shm"
        assert 0 < pool < size and 0 < store < size and pool + store <= size, (group["groupName"], pool, store)
        assert float(env["OMNI_SERVE_DATA_TTL_S"]) > 0 and env["OMNI_SERVE_RAY_NAMESPACE"]
        # pods are separate Ray nodes: the chart names the backend of `auto` edges rather than guess
        assert env["OMNI_SERVE_AUTO_CONNECTOR"] == "ray"
        memory_limit = container["resources"]["limits"]["memory"]
        assert _quantity_mib(memory_limit) * MiB > size, "tmpfs pages count against the memory limit"
        # Ray auth is the operator's: KubeRay sets RAY_AUTH_MODE / RAY_AUTH_TOKEN from ray.authOptions.
        assert "RAY_AUTH_MODE" not in env and "RAY_AUTH_TOKEN" not in env
        # node-death detection bounded by the head's health checks (docs/multinode.md); set on the head only
        checks = {k: env.get(f"RAY_health_check_{k}") for k in ("period_ms", "timeout_ms", "failure_threshold")}
        if group["groupName"] == "head":
            assert int(checks["period_ms"]) * int(checks["failure_threshold"]) <= 10_000, checks
        else:
            assert set(checks.values()) == {None}, checks


@pytest.mark.parametrize("case", list(CASES))
def test_every_pod_drains_before_ray_stops_within_its_grace_period(renders, case):
    """preStop: `omni-serve drain-node` (Serve moves the pod's replicas away, their requests finish), then
    `ray stop`; Kubernetes waits the drain's deadline plus a margin before it kills the pod."""
    for group in _groups(_rayservice(renders[case])):
        pod = group["template"]["spec"]
        command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        drain = re.fullmatch(r"omni-serve drain-node --deadline-s (\d+); ray stop", command[-1])
        assert command[:2] == ["/bin/sh", "-c"] and drain, command
        assert pod["terminationGracePeriodSeconds"] >= int(drain.group(1)) + 5, (group["groupName"], pod)
        # Serve stops a migrating replica at the drain's deadline minus its graceful timeout (by default the
        # request deadline): the deadline leaves a replacement at least a minute to start first
        deadline = _graph_spec(renders[case]).ingress.request_timeout_s
        assert int(drain.group(1)) >= deadline + 60, (drain.group(1), deadline)


def test_the_drain_waits_until_nothing_of_serve_is_left_or_the_deadline():
    import io

    from omni_serve.deployments.drain_node import wait_until_gone

    now, seen = [0.0], iter([["qwen_image:dit", "proxy"], ["proxy"], []])
    out = io.StringIO()
    assert wait_until_gone(lambda: next(seen), 60, 2, out, clock=lambda: now[0],
                           sleep=lambda s: now.__setitem__(0, now[0] + s)) == 0
    assert "drained" in out.getvalue() and "qwen_image:dit" in out.getvalue()
    now[0], out = 0.0, io.StringIO()
    assert wait_until_gone(lambda: ["qwen_image:dit"], 5, 2, out, clock=lambda: now[0],
                           sleep=lambda s: now.__setitem__(0, now[0] + s)) == 1
    assert "deadline: still on this node after 6 s: qwen_image:dit" in out.getvalue()


# --------------------------------------------------------------------------------- Ray Serve config + spec


@pytest.mark.parametrize("case", list(CASES))
def test_serve_config_validates_as_ray_serve_deploy_schema(renders, case):
    from ray.serve.schema import ServeDeploySchema

    config = _serve_config(renders[case])
    ServeDeploySchema.model_validate(config)
    assert config["proxy_location"] == "EveryNode"
    assert config["http_options"]["host"] == "0.0.0.0"
    serve_ports = {p["containerPort"] for c in _ray_containers(_rayservice(renders[case]))
                   for p in c["ports"] if p["name"] == "serve"}
    assert serve_ports == {config["http_options"]["port"]}
    graph = (CASES[case].get("graph") or {}).get("name", "qwen2_5_omni")
    assert _app(renders[case])["import_path"] == families()[graph].app


def _built(**values) -> dict:
    from omni_serve.graph.serve_config import build_serve_config

    config, _ = build_serve_config("qwen2_5_omni", {"checkpoint": "/models/checkpoint", **values})
    return config


def test_a_config_built_by_omni_serve_is_deployed_as_written(chart):
    """`serveConfig` (omni-serve build's output): the chart deploys its applications as written, so an upgrade
    that changes one stage changes only that stage's deployment entry (Serve rolls only it)."""
    built = _built()
    config = _serve_config(_render(chart, {"serveConfig": yaml.safe_dump(built)}))
    assert config["applications"] == built["applications"]
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000} and config["proxy_location"] == "EveryNode"
    changed = _serve_config(_render(chart, {"serveConfig": yaml.safe_dump(_built(**{"stages.talker.num_cpus": 2}))}))
    (before,), (after,) = config["applications"], changed["applications"]
    assert before["args"] == after["args"]
    assert [a["name"] for a, b in zip(after["deployments"], before["deployments"]) if a != b] == ["talker"]


@pytest.mark.parametrize("values, message", [
    ({"serveConfig": "- not a config"}, "not a Serve config"),
    ({"serveConfig": yaml.safe_dump(_built()), "graph": {"name": "qwen_image"}}, "serves omni_serve.families.qwen2_5"),
    ({"serveConfig": yaml.safe_dump(_built(checkpoint="/elsewhere"))}, "build with checkpoint=/models/checkpoint"),
    ({"serveConfig": yaml.safe_dump(_built()), "stages": {"talker": {"num_cpus": 1}}}, "leave them empty"),
    ({"serveConfig": yaml.safe_dump(_built()), "graph": {"routePrefix": "/omni"}}, "build with --route-prefix /omni"),
    ({"serveConfig": yaml.safe_dump(_built()), "graph": {"appName": "omni"}}, "build with --name omni"),
])
def test_a_built_config_must_match_the_chart(chart, values, message):
    with pytest.raises(Exception, match=message):
        chart.render(keyed(values), name="omni", namespace="omni", is_install=True)


@pytest.mark.parametrize("case", list(CASES))
def test_app_args_validate_against_the_graph_spec(renders, case):
    app = _app(renders[case])
    spec = _graph_spec(renders[case])
    mount = CASES[case].get("checkpoint", {}).get("mountPath", "/models/checkpoint")
    assert spec.checkpoint == mount
    # Settings given for a stage the layout does not deploy would be silently ignored.
    assert set(app["args"].get("stages", {})) <= set(_deployed(spec))
    # Values reach the spec unchanged (numbers stay numbers through Helm's JSON values).
    for stage, settings in CASES[case].get("stages", {}).items():
        dumped = getattr(spec.stages, stage).model_dump()
        for key, value in settings.items():
            if key in ("num_cpus", "num_gpus", "resources", "num_replicas"):
                assert dumped[key] == value, (stage, key)


def test_gpu_example_args_in_detail(renders):
    spec = _graph_spec(renders["gpu-prod"])
    assert spec.data_plane.mooncake.protocol == "rdma"
    # every edge of the layout crosses pods: all on Mooncake (the ingress' media too)
    graph = families()["qwen2_5_omni"].graph
    assert {getattr(spec.edges, link.edge).connector for link in graph.links(spec.layout())} == {"mooncake"}
    for stage in spec.deployed_stages():
        settings = getattr(spec.stages, stage)
        assert settings.engine.device == "cuda" and settings.engine.dtype == "bfloat16", stage
        assert 0 < settings.num_gpus < 1 and settings.autoscaling_config, stage
    app = _app(renders["gpu-prod"])
    assert app["autoscaling_policy"]["policy_function"] == "omni_serve.autoscaling:StageRatioPolicy"


@pytest.mark.parametrize("mutate, field", [
    (lambda args: args["stages"]["thinker"].update(num_replica=2), "num_replica"),
    (lambda args: args["stages"]["talker"]["engine"].update(dtyp="bfloat16"), "dtyp"),
    (lambda args: args["stages"]["code2wav"]["params"].update(num_step=4), "num_step"),
    (lambda args: args["edges"]["thinker_talker"].update(connector="nvlink"), "connector"),
    (lambda args: args["stages"]["thinker"].update(num_gpus=-1), "num_gpus"),
])
def test_graph_spec_rejects_typos_in_rendered_args(renders, mutate, field):
    """The spec check above is not vacuous: a typo'd or invalid field in the rendered args fails it."""
    args = copy.deepcopy(_app(renders["gpu-prod"])["args"])
    OmniGraphSpec.model_validate(args)
    mutate(args)
    with pytest.raises(ValidationError) as exc:
        OmniGraphSpec.model_validate(args)
    assert field in str(exc.value)


# ------------------------------------------------------------------------------------------- autoscaling


def _import_attr(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _policy_checked(policy: dict):
    """Instantiate a policy class with its kwargs (the classes validate them)."""
    target = _import_attr(policy["policy_function"])
    if isinstance(target, type):
        target(**policy.get("policy_kwargs", {}))


@pytest.mark.parametrize("case", list(CASES))
def test_autoscaling_configs_validate_as_ray_autoscaling_config(renders, case):
    from ray.serve.config import AutoscalingConfig

    spec = _graph_spec(renders[case])
    for stage in _deployed(spec):
        config = getattr(spec.stages, stage).autoscaling_config
        if not config:
            continue
        validated = AutoscalingConfig.model_validate(config)  # imports the policy
        assert validated.min_replicas <= validated.max_replicas
        if "policy" in config:
            _policy_checked(config["policy"])
    policy = _app(renders[case]).get("autoscaling_policy")
    if policy:
        _policy_checked(policy)
        deployed = set(_deployed(spec))
        for ratio in policy["policy_kwargs"].get("ratios", []):
            assert {ratio["stage"], ratio["per"]} <= deployed, ratio
        assert any(getattr(spec.stages, s).autoscaling_config for s in deployed)


# ------------------------------------------------------------------------------------------- checkpoint


def test_generated_checkpoint_init_container_runs_the_cli(renders, monkeypatch):
    calls = []
    import omni_serve.graph.registry as registry

    monkeypatch.setattr(registry, "import_path", lambda path: lambda out, size, seed: calls.append((out, size, seed)))
    for case, family in (("cpu-demo", "qwen2_5_omni"), ("qwen-image", "qwen_image")):
        rs = _rayservice(renders[case])
        for group in _groups(rs):
            pod = group["template"]["spec"]
            (init,) = pod["initContainers"]
            command = init["command"]
            assert command[:3] == ["omni-serve", "make-checkpoint", family]
            assert cli.main(command[1:]) == 0
            mount = _app(renders[case])["args"]["checkpoint"]
            assert calls.pop() == (mount, "tiny", 0)
            assert {m["mountPath"] for m in init["volumeMounts"]} == {mount}
            (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoint"]
            assert "emptyDir" in volume


def test_checkpoint_from_a_pvc_or_a_host_path(renders):
    rs = _rayservice(renders["gpu-prod"])
    for group in _groups(rs):
        pod = group["template"]["spec"]
        assert "initContainers" not in pod
        (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoint"]
        assert volume["persistentVolumeClaim"] == {"claimName": "qwen-omni-weights", "readOnly": True}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "checkpoint"]
        assert mount == {"name": "checkpoint", "mountPath": "/models/Qwen2.5-Omni-7B",
                         "subPath": "Qwen2.5-Omni-7B", "readOnly": True}
    pod = _groups(_rayservice(renders["omni-disagg"]))[0]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoint"]
    assert volume["hostPath"] == {"path": "/data/models", "type": "Directory"}


def test_a_job_api_gets_the_shared_job_volume_and_its_database_url_from_a_secret(renders):
    rs = _rayservice(renders["wan-jobs"])
    args = _app(renders["wan-jobs"])["args"]
    assert args["jobs"] == {"dir": "/var/lib/omni_serve/jobs", "result_ttl_s": 86400}
    assert len(_groups(rs)) == 2  # the head and the worker group: every Ray pod mounts it
    for group in _groups(rs):
        pod = group["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "jobs"]
        assert volume["persistentVolumeClaim"] == {"claimName": "video-jobs"}
        container = pod["containers"][0]
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "jobs"]
        assert mount == {"name": "jobs", "mountPath": "/var/lib/omni_serve/jobs", "subPath": "wan"}
        (env,) = [e for e in container["env"] if e["name"] == "OMNI_SERVE_JOBS_URL"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "video-jobs-db", "key": "url"}
    default = _rayservice(renders["default"])
    assert not [v for g in _groups(default) for v in g["template"]["spec"]["volumes"] if v["name"] == "jobs"]
    assert not [e for c in _ray_containers(default) for e in c["env"] if e["name"] == "OMNI_SERVE_JOBS_URL"]


# ------------------------------------------------------------------------------------------- values schema


@pytest.mark.parametrize("values, message", [
    ({"graph": {"name": "no_such_graph"}}, "graph/name"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": -1, "maxReplicas": 2}]}, "minReplicas"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": 1, "maxReplicas": 2, "replicas": -3}]}, "replicas"),
    ({"workerGroups": [{"name": "CPU_group", "minReplicas": 1, "maxReplicas": 2}]}, "name"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": 1, "maxReplicas": 2, "replica": 1}]}, "replica"),
    ({"stages": {"thinker": {"num_replicas": 0}}}, "num_replicas"),
    ({"stages": {"thinker": {"num_replica": 2}}}, "num_replica"),
    ({"stages": {"thinkr": {}}}, "thinkr"),
    ({"stages": {"thinker": {"resources": {"omni_cpu": -1}}}}, "resources"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"sharedMemory": {"sizeMiB": 16}}, "sizeMiB"),
    ({"checkpoint": {"generate": {"size": "huge"}}}, "size"),
    ({"serve": {"port": 70000}}, "port"),
    ({"replicaCount": 2}, "replicaCount"),
    ({"ray": {"authOptions": {"mode": "on"}}}, "mode"),
    ({"apiKey": {"existingSecret": "Not_A_Secret_Name"}}, "existingSecret"),
    ({"apiKey": {"secretKey": ""}}, "secretKey"),
    ({"networkPolicy": {"serveFrom": [{}]}}, "serveFrom"),
    ({"networkPolicy": {"serveFrom": [{"podSelectr": {}}]}}, "podSelectr"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": 1, "maxReplicas": 1, "rdma": "yes"}]}, "rdma"),
    ({"head": {"rayClient": {"enabled": "yes"}}}, "enabled"),
    ({"jobs": {"mountPath": "relative"}}, "mountPath"),
    ({"jobs": {"databaseUrlSecret": {"url": "postgresql://u:p@h/db"}}}, "url"),
])
def test_values_schema_rejects_bad_values(chart, values, message):
    with pytest.raises(helm_python.HelmValuesError, match=message):
        chart.validate_schema(values)
    with pytest.raises(helm_python.HelmValuesError):
        chart.render(values, name="omni", namespace="omni")


@pytest.mark.parametrize("values, message", [
    ({"stages": {"dit": {"num_cpus": 1}}}, "graph qwen2_5_omni has no stage"),
    ({"args": {"checkpoint": "/elsewhere"}}, "args.checkpoint"),
    ({"args": {"stages": {"thinker": {}}}}, "args.stages"),
    ({"checkpoint": {"existingClaim": "weights"}}, "exactly one checkpoint source"),
    ({"checkpoint": {"generate": {"enabled": False}}}, "exactly one checkpoint source"),
    ({"sharedMemory": {"sizeMiB": 512, "objectStoreMiB": 256, "poolMiB": 512}}, "exceed sizeMiB"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": 3, "maxReplicas": 2}]}, "above maxReplicas"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": 1, "maxReplicas": 2, "replicas": 5}]}, "outside"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": 1, "maxReplicas": 1}] * 2}, "duplicate group name"),
    ({"workerGroups": [{"name": "cpu", "minReplicas": 1, "maxReplicas": 2, "idleTimeoutSeconds": 60}]},
     "needs the Ray autoscaler v2"),
    ({"head": {"rayResources": {"CPU": 0}, "rayStartParams": {"num-cpus": "0"}}}, "both in rayResources"),
    ({"head": {"rayStartParams": {"labels": "a=b"}}}, "rayStartParams.labels"),
    ({"head": {"rayStartParams": {"dashboard-host": "127.0.0.1"}}}, "must listen on the pod IP"),
    ({"head": {"ports": [{"name": "dashboard", "containerPort": 8266}]}}, "declared by the chart"),
    ({"ray": {"authOptions": {"mode": "disabled", "secretName": "tok"}}}, "apply to mode: token"),
    ({"jobs": {"existingClaim": "video-jobs"}}, "graph qwen2_5_omni keeps no jobs"),
    ({"graph": {"name": "wan"}, "jobs": {"databaseUrlSecret": {"name": "db"}}}, "needs jobs.existingClaim"),
    ({"graph": {"name": "wan"}, "jobs": {"existingClaim": "v"}, "args": {"jobs": {"dir": "/x"}}}, "args.jobs.dir"),
])
def test_template_checks_reject_inconsistent_values(chart, values, message):
    chart.validate_schema(values)  # valid per key; inconsistent together
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        chart.render(values, name="omni", namespace="omni")


def test_chart_schema_follows_the_graph_specs():
    """The chart's per-stage schema and stage/graph names follow the pydantic specs and the CLI."""
    with open(os.path.join(CHART, "values.schema.json")) as f:
        schema = json.load(f)
    stages = schema["properties"]["stages"]
    assert set(stages["additionalProperties"]["properties"]) == set(StageSpec.model_fields)
    spec_stages = {name for cls in SPECS.values() for name in cls.model_fields["stages"].annotation.model_fields}
    assert set(stages["propertyNames"]["enum"]) == spec_stages
    assert set(schema["properties"]["graph"]["properties"]["name"]["enum"]) == {*families(), "combined"}
    assert set(families()) == set(SPECS)
    assert set(schema["properties"]["combined"]["properties"]["graphs"]["propertyNames"]["enum"]) == set(families())
    assert {name for name, f in families().items() if f.checkpoint_writer} >= set(SPECS)


@pytest.mark.parametrize("graph", sorted(SPECS))
def test_chart_accepts_every_stage_of_each_graph(chart, graph):
    stage_names = list(SPECS[graph].model_fields["stages"].annotation.model_fields)
    values = {"graph": {"name": graph}, "stages": {name: {"num_cpus": 0.25} for name in stage_names}}
    app = _app(_render(chart, values))
    assert app["import_path"] == families()[graph].app
    SPECS[graph].model_validate(app["args"])


def test_every_value_is_documented():
    """Every key of values.yaml has a comment above it, is inside a commented value (e.g. the keys of a
    documented `resources`), or is a block whose keys are all documented."""
    with open(os.path.join(CHART, "values.yaml")) as f:
        lines = f.read().splitlines()
    nodes, stack = [], []  # node: [key, documented, is_block, children]
    previous = ""
    for line in lines:
        match = re.match(r"^(\s*)([A-Za-z][\w./-]*):(.*)$", line)
        if match:
            indent = len(match.group(1))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            inherited = any(node[1] for _, node in stack)
            node = [match.group(2), previous.startswith("#") or inherited, not match.group(3).strip(), []]
            (stack[-1][1][3] if stack else nodes).append(node)
            stack.append((indent, node))
        if line.strip():
            previous = line.strip()

    def undocumented(node) -> list[str]:
        key, documented, is_block, children = node
        if documented:
            return []
        missing = [f"{key}.{m}" for child in children for m in undocumented(child)]
        return missing if is_block and children else [key]

    assert not [m for node in nodes for m in undocumented(node)]


# ------------------------------------------------------------------------------------------- security


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@pytest.mark.parametrize("case", EXAMPLES)
def test_ray_token_auth_is_on_by_default(renders, case):
    cluster = _rayservice(renders[case])["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}  # KubeRay generates the token Secret


def test_ray_auth_uses_a_named_secret_or_is_disabled_only_when_asked(chart):
    def auth(values):
        return _rayservice(_render(chart, values))["spec"]["rayClusterConfig"].get("authOptions")

    assert auth({"ray": {"authOptions": {"secretName": "omni-ray-token"}}}) == {
        "mode": "token", "secretName": "omni-ray-token"}
    assert auth({"ray": {"authOptions": {"mode": "disabled"}}}) == {"mode": "disabled"}
    # An empty map merges with the default: still token.
    assert auth({"ray": {"authOptions": {}}}) == {"mode": "token"}
    assert "Ray token authentication is on" in _notes(chart, {})
    assert "WARNING: Ray authentication is off" in _notes(chart, {"ray": {"authOptions": {"mode": "disabled"}}})


@pytest.mark.parametrize("case", EXAMPLES)
def test_head_exposes_only_the_ray_ports_kuberay_needs(renders, case):
    """gcs-server (workers join through the head Service) and dashboard (the operator deploys the Serve config
    through it) besides serve and metrics; the Ray Client port only when asked. The dashboard listens on the
    pod IP (KubeRay needs it), behind the Ray token and the NetworkPolicy."""
    rs = _rayservice(renders[case])
    head = _groups(rs)[0]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"gcs-server": 6379, "dashboard": 8265, "serve": 8000, "metrics": 8080}
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert rs["spec"]["rayClusterConfig"]["authOptions"]["mode"] == "token"
    policy = _network_policy(renders[case])
    dashboard_rules = [r for r in policy["spec"]["ingress"] if 8265 in {p["port"] for p in r.get("ports", [])}]
    (rule,) = dashboard_rules
    assert rule["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kuberay-operator"}}}]


def test_ray_client_port_only_when_enabled(renders):
    head = _groups(_rayservice(renders["omni-disagg"]))[0]
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["client"] == 10001
    for group in _groups(_rayservice(renders["default"])):
        assert "client" not in {p["name"] for p in group["template"]["spec"]["containers"][0]["ports"]}


# The shape of a networking.k8s.io/v1 NetworkPolicy (the API's required fields, enums and one-of rules).
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False, "properties": {
            "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
            "values": {"type": "array", "items": {"type": "string"}}}}}}}
_PEER = {"type": "object", "minProperties": 1, "additionalProperties": False, "properties": {
    "podSelector": _SELECTOR, "namespaceSelector": _SELECTOR,
    "ipBlock": {"type": "object", "required": ["cidr"], "additionalProperties": False, "properties": {
        "cidr": {"type": "string"}, "except": {"type": "array", "items": {"type": "string"}}}}},
    "not": {"required": ["ipBlock"], "anyOf": [{"required": ["podSelector"]}, {"required": ["namespaceSelector"]}]}}
_PORT = {"type": "object", "additionalProperties": False, "properties": {
    "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
    "port": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535}, {"type": "string", "minLength": 1}]},
    "endPort": {"type": "integer", "minimum": 1, "maximum": 65535}}}
NETWORK_POLICY_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"}, "kind": {"const": "NetworkPolicy"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["podSelector"], "additionalProperties": False, "properties": {
            "podSelector": _SELECTOR,
            "policyTypes": {"type": "array", "uniqueItems": True, "items": {"enum": ["Ingress", "Egress"]}},
            "ingress": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
                "from": {"type": "array", "items": _PEER}, "ports": {"type": "array", "items": _PORT}}}},
            "egress": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
                "to": {"type": "array", "items": _PEER}, "ports": {"type": "array", "items": _PORT}}}}}}}}


def _policy_errors(policy: dict) -> list[str]:
    validator = jsonschema.Draft7Validator(NETWORK_POLICY_SCHEMA)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(policy)]


def test_network_policy_shape_check_can_fail(renders):
    policy = copy.deepcopy(_network_policy(renders["default"]))
    policy["spec"]["policyTypes"] = ["Inbound"]
    policy["spec"]["ingress"][0]["from"][0]["ipBlock"] = {"cidr": "0.0.0.0/0"}  # ipBlock with a selector
    policy["spec"]["ingress"][1]["ports"][0]["protocol"] = "HTTP"
    assert len(_policy_errors(policy)) == 3, _policy_errors(policy)


@pytest.mark.parametrize("case", [*EXAMPLES, "omni-disagg"])
def test_network_policy_admits_only_what_the_release_needs(renders, case):
    render, values = renders[case], CASES[case]
    policy = _network_policy(render)
    assert not _policy_errors(policy), _policy_errors(policy)
    spec = policy["spec"]
    # It selects every Ray pod of the release, and only them (the release's selector labels).
    selector = spec["podSelector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "omni-serve", "app.kubernetes.io/instance": "omni"}
    for group in _groups(_rayservice(render)):
        labels = group["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in selector.items()), group["groupName"]
    rules = spec["ingress"]
    # 1. Every port (Ray's GCS, raylet, object manager and worker ports, Mooncake) from the release's pods only.
    assert rules[0] == {"from": [{"podSelector": {"matchLabels": selector}}]}
    # 2. Nothing but the Serve port is open to any source; rules with ports name them all.
    open_ports = {p["port"] for r in rules if "from" not in r for p in r["ports"]}
    serve_from = (values.get("networkPolicy") or {}).get("serveFrom")
    assert open_ports == (set() if serve_from else {8000})
    assert all(r.get("ports") for r in rules[1:])
    by_port = {p["port"]: r.get("from") for r in rules[1:] for p in r["ports"]}
    operator = [{"namespaceSelector": {},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]
    assert by_port[8265] == operator
    if serve_from:
        assert by_port[8000] == [*serve_from, *operator]  # KubeRay checks the proxies' health
    # 3. The metrics port from the monitoring namespace, when a monitor scrapes it.
    metrics = values.get("metrics", {})
    monitored = any(metrics.get(m, {}).get("enabled") for m in ("serviceMonitor", "podMonitor"))
    assert (8080 in by_port) == monitored
    if monitored:
        assert by_port[8080] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert set(by_port) <= {8000, 8265, 8080}
    # 4. Egress: unrestricted unless configured.
    egress = (values.get("networkPolicy") or {}).get("egress")
    assert spec["policyTypes"] == (["Ingress", "Egress"] if egress else ["Ingress"])
    if egress:
        assert spec["egress"][0] == {"to": [{"podSelector": {"matchLabels": selector}}]}
        assert {(p["protocol"], p["port"]) for p in spec["egress"][1]["ports"]} == {("UDP", 53), ("TCP", 53)}
        assert spec["egress"][2:] == egress
    else:
        assert "egress" not in spec


def test_network_policy_can_be_disabled(chart):
    render = _render(chart, {"networkPolicy": {"enabled": False}})
    assert _network_policy(render) is None
    assert "NetworkPolicy" not in _notes(chart, {"networkPolicy": {"enabled": False}})


@pytest.mark.parametrize("case", list(CASES))
def test_every_container_runs_non_root_without_privileges(renders, case):
    rs = _rayservice(renders[case])
    for group in _groups(rs):
        pod = group["template"]["spec"]
        pod_sc = pod["securityContext"]
        assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 1000, group["groupName"]
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod_sc["fsGroup"] == CASES[case].get("podSecurityContext", {}).get("fsGroup", 100)
        for container in _containers(pod):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (group["groupName"], container["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (group["groupName"], container["name"])
            assert not sc.get("privileged") and sc.get("runAsUser", 1000) != 0
    cluster = rs["spec"]["rayClusterConfig"]
    if cluster.get("enableInTreeAutoscaling"):
        sc = cluster["autoscalerOptions"]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]


def _added_capabilities(rs: dict) -> dict[str, set[str]]:
    return {f"{g['groupName']}/{c['name']}": set(c["securityContext"]["capabilities"].get("add", []))
            for g in _groups(rs) for c in _containers(g["template"]["spec"])}


def test_ipc_lock_only_on_the_rdma_worker_groups(renders):
    """Mooncake over RDMA registers (pins) memory: IPC_LOCK, and only there, in the groups declaring rdma."""
    values = CASES["gpu-prod"]
    assert values["args"]["data_plane"]["mooncake"]["protocol"] == "rdma"
    rdma_groups = {g["name"] for g in values["workerGroups"] if g.get("rdma")}
    # Every worker group hosts Mooncake-connected replicas (the ingress included); the head hosts none.
    assert rdma_groups == {g["name"] for g in values["workerGroups"]} and not values["head"].get("rdma")
    added = _added_capabilities(_rayservice(renders["gpu-prod"]))
    assert {name: caps for name, caps in added.items() if caps} == {
        f"{group}/ray-worker": {"IPC_LOCK"} for group in rdma_groups}
    for case in ("default", "cpu-demo", "qwen-image", "omni-disagg"):
        assert not any(_added_capabilities(_rayservice(renders[case])).values()), case


def test_rdma_adds_ipc_lock_to_a_groups_own_security_context(chart):
    values = {"workerGroups": [{"name": "cpu", "minReplicas": 1, "maxReplicas": 1, "rdma": True,
                                "securityContext": {"capabilities": {"add": ["NET_RAW"]},
                                                    "readOnlyRootFilesystem": True}}]}
    (worker,) = _ray_containers(_rayservice(_render(chart, values)))[1:]
    sc = worker["securityContext"]
    assert sc["capabilities"] == {"add": ["NET_RAW", "IPC_LOCK"], "drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("values, secret, key", [
    ({"apiKey": {"existingSecret": "omni-api-key"}}, "omni-api-key", "api-key"),
    ({**CASES["cpu-demo"], "apiKey": {"existingSecret": "keys", "secretKey": "openai"}}, "keys", "openai"),
])
def test_api_key_comes_from_the_named_secret(chart, values, secret, key):
    rs = _rayservice(_render(chart, values))
    for group in _groups(rs):
        pod = group["template"]["spec"]
        env = pod["containers"][0]["env"]
        (api_key,) = [e for e in env if e["name"] == "OMNI_SERVE_API_KEY"]
        assert api_key == {"name": "OMNI_SERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}
        for init in pod.get("initContainers", []):
            assert "OMNI_SERVE_API_KEY" not in {e["name"] for e in init.get("env", [])}
    notes = _notes(chart, values)
    assert "the API is open" not in notes and f"get secret {secret}" in notes and "Bearer $KEY" in notes


@pytest.mark.parametrize("values", [{}, {"apiKey": {"existingSecret": ""}}, {"apiKey": {"secretKey": "k"}},
                                    {"apiKey": {"allowUnauthenticated": False}}])
def test_the_chart_refuses_to_render_without_an_api_key(chart, values):
    with pytest.raises(helm_python.HelmRenderError, match=re.escape("apiKey: no API key is set")) as err:
        chart.render(values, name="omni", namespace="omni")
    assert "apiKey.allowUnauthenticated=true" in str(err.value)


def test_only_an_explicitly_open_api_renders_without_a_key_and_notes_warn(chart, renders):
    assert CASES["cpu-demo"]["apiKey"] == {"allowUnauthenticated": True}
    assert CASES["gpu-prod"]["apiKey"]["existingSecret"]
    for container in _ray_containers(_rayservice(renders["cpu-demo"])):
        assert "OMNI_SERVE_API_KEY" not in {e["name"] for e in container["env"]}
    notes = _notes(chart, CASES["cpu-demo"])
    assert "WARNING: the API is open" in notes and "--from-literal=api-key=" in notes


# ------------------------------------------------------------------------------------------- k8s/ golden


def test_k8s_manifests_are_a_fresh_render_of_the_chart():
    script = _load_render_script()
    for filename in script.MANIFESTS:
        with open(os.path.join(ROOT, "k8s", filename)) as f:
            committed = f.read()
        assert committed == script.render(filename), (
            f"k8s/{filename} is stale: run `.venv/bin/python scripts/render_k8s.py`")
        docs = [d for d in yaml.safe_load_all(committed) if d]
        assert docs[0]["kind"] == "RayService"
        assert all(d["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "kubectl" for d in docs)


def test_the_charts_graph_table_is_a_fresh_render_of_the_family_registry():
    script = _load_render_script()
    with open(script.GRAPHS_FILE) as f:
        assert f.read() == script.chart_graphs(), "helm/omni-serve/graphs.yaml is stale: run scripts/render_k8s.py"
    with open(script.SCHEMA_FILE) as f:
        current = f.read()
    assert current == script.chart_schema(current), "values.schema.json names are stale: run scripts/render_k8s.py"


# ------------------------------------------------------------------------------------------- Dockerfile


def test_dockerfile_installs_what_kuberay_and_omni_serve_need():
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = f.read()
    assert re.search(r"^FROM python:3\.11-slim", text, re.M)
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.M) and '"torch==${TORCH_VERSION}"' in text
    assert "libibverbs1" in text and "wget" in text and "bash" in text
    assert re.search(r"pip install[^\n]*\s\.(\s|$)", text)
    assert "mooncake-transfer-engine-non-cuda" in text and "mooncake-transfer-engine==" in text


# ------------------------------------------------------------------------------------------- combined apps
def test_the_voice_values_render_one_release_of_two_graphs(chart, qwen3_asr_tiny_dir, vibevoice_tiny_dir):
    """values-voice.yaml (graph.name combined): one application built by omni_serve.deployments.combined, each
    graph's checkpoint in its own directory of the volume (generated by one initContainer each), its args and stages
    under graphs.<graph>, what the graphs share at the top; the args validate as the combined builder reads them,
    and the RayService as KubeRay's CRD."""
    from ray.serve.schema import ServeDeploySchema

    from omni_serve.deployments.combined import validate
    from tests.unit.helm_chart_support import _load_values

    render = _render(chart, _load_values("values-voice.yaml"))
    rs = _rayservice(render)
    assert not [e.message for e in _crd_validator().iter_errors(rs)]
    ServeDeploySchema.model_validate(_serve_config(render))
    app = _app(render)
    assert app["import_path"] == "omni_serve.deployments.combined:build_app" and app["name"] == "voice"
    args = app["args"]
    mount = CASES["default"].get("checkpoint", {}).get("mountPath", "/models/checkpoint")
    assert {g: a["checkpoint"] for g, a in args["graphs"].items()} == {
        "vibevoice": f"{mount}/vibevoice", "qwen3_asr": f"{mount}/qwen3_asr"}
    assert args["graphs"]["vibevoice"]["stages"]["lm"]["num_cpus"] == 2 and args["ingress"]["request_timeout_s"] == 300
    for group in _groups(rs):
        inits = group["template"]["spec"]["initContainers"]
        assert [(i["name"], i["command"][2], i["command"][-1]) for i in inits] == [
            ("make-checkpoint-qwen3-asr", "qwen3_asr", f"{mount}/qwen3_asr"),
            ("make-checkpoint-vibevoice", "vibevoice", f"{mount}/vibevoice")]
    local = {"qwen3_asr": qwen3_asr_tiny_dir, "vibevoice": vibevoice_tiny_dir}
    for graph, values in args["graphs"].items():
        values["checkpoint"] = local[graph]
    assert sorted(s.model_name for _, s in validate(args)[1]) == ["qwen3-asr", "vibevoice"]


@pytest.mark.parametrize("change, message", [
    ({"combined": {"graphs": {}}}, "list the graphs to serve together"),
    ({"stages": {"lm": {"num_cpus": 1}}}, "set each graph's stages in combined.graphs"),
    ({"args": {"model_name": "x"}}, "args holds what the graphs share"),
    ({"combined": {"graphs": {"vibevoice": {"stages": {"dit": {}}}}}}, "graph vibevoice has no stage"),
    ({"combined": {"graphs": {"vibevoice": {"args": {"checkpoint": "/x"}}}}}, "the chart sets the checkpoint"),
    ({"graph": {"name": "qwen3_asr"}}, "combined.graphs applies to graph.name combined"),
])
def test_a_combined_release_refuses_what_does_not_apply(chart, change, message):
    from tests.unit.helm_chart_support import _load_values

    values = _load_values("values-voice.yaml")
    for key, value in change.items():
        values[key] = {**values.get(key, {}), **value} if key != "stages" and key != "args" else value
    with pytest.raises(helm_python.HelmRenderError, match=re.escape(message)):
        chart.render(keyed(values), name="omni", namespace="omni")
