"""A complete Ray Serve config for a graph: what ``omni-serve build`` writes for ``serve run`` / ``serve deploy``.

Contract: ``build_serve_config(graph, values, ...)`` validates ``values`` (dotted keys allowed) against the spec
of the family named ``graph`` (``omni_serve.graph.registry``) and returns a Serve config dict that validates as
Ray's ``ServeDeploySchema``: one application whose ``args`` are the validated graph-level spec (every default
written out, so a deployed config does not change when omni_serve's defaults do) and each stage's engine backend
(the graph's shape), whose ``deployments`` carry each stage's settings (``omni_serve.graph.stage_settings``: a
redeploy that changes one stage rolls only that stage; a replica count the family's sizing rule decides and the
user left unset is left out, so the builder sizes it on the cluster), the graph's application-level ``autoscaling_policy`` (which only a config file can carry) and the HTTP
options. Edit the graph spec and build again rather than editing the ``deployments`` entries by hand: each
carries its stage's whole spec, as JSON, in its replicas' environment.

The checkpoint path is made absolute when it exists here. A path that does not exist here must be
absolute (the path where the cluster sees it, e.g. a volume in a pod): a relative one would resolve
against the Serve controller's working directory.
"""

from __future__ import annotations

import os
from typing import Any

from omni_serve.graph.registry import family as find_family


def resolve_checkpoint(checkpoint: str, marker: str) -> tuple[str, str | None]:
    """(path to write, a note for the user or None)."""
    local = os.path.abspath(os.path.expanduser(checkpoint))
    if os.path.isfile(os.path.join(local, marker)):
        return local, None
    if not os.path.isabs(checkpoint):
        raise ValueError(f"checkpoint {checkpoint!r} is not a checkpoint directory here (no {marker}); give "
                         "the absolute path the cluster sees (a relative path would resolve against the Serve "
                         "controller's working directory)")
    return checkpoint, f"checkpoint {checkpoint} does not exist on this machine: it must exist on the cluster"


def build_serve_config(graph: str, values: dict[str, Any], *, app_name: str | None = None,
                       route_prefix: str = "/", host: str = "0.0.0.0", port: int = 8000
                       ) -> tuple[dict[str, Any], list[str]]:
    """(Serve config, notes). Raises ValueError (pydantic's ValidationError is one) on bad values."""
    from ray.serve.schema import ServeDeploySchema

    family = find_family(graph)
    spec = family.parse(values)
    checkpoint, note = resolve_checkpoint(spec.checkpoint, family.checkpoint_marker)
    from omni_serve.graph.sizing import left_to_cluster
    from omni_serve.graph.stage_settings import deployment_entries, in_args

    spec = spec.model_copy(update={"checkpoint": checkpoint})
    args = spec.model_dump(mode="json", exclude={"stages"})
    # each stage's engine backend decides the graph's shape (a family's layout may follow it): the builder needs
    # it, and changing it redeploys the graph
    args["stages"] = {}
    for name in type(spec.stages).model_fields:
        stage_spec = spec.stage_spec(name)
        args["stages"][name] = (stage_spec.model_dump(mode="json") if in_args(stage_spec)
                                else {"engine": {"backend": stage_spec.engine.backend}})
    deployed = [stage.name for stage in family.graph.deployed(spec.layout())]
    entries = deployment_entries(spec, deployed)
    sized = left_to_cluster(family, spec, values)  # the builder sizes them on the cluster: no entry may fix them
    for entry in entries:
        if f"stages.{entry['name']}.num_replicas" in sized:
            entry.pop("num_replicas", None)
    app: dict[str, Any] = {"name": app_name or graph, "route_prefix": route_prefix,
                           "import_path": family.app, "args": args, "deployments": entries}
    if spec.autoscaling_policy:
        app["autoscaling_policy"] = spec.autoscaling_policy
    config = {"proxy_location": "EveryNode", "http_options": {"host": host, "port": port},
              "applications": [app]}
    ServeDeploySchema.model_validate(config)
    return config, [note] if note else []


HEADER = """\
# Ray Serve config for the {graph} graph, written by `omni-serve build` (omni_serve {version}).
#   serve run {path}           (local: starts Ray and serves; RAY_AUTH_MODE=disabled without Ray auth)
#   serve deploy {path}        (a running cluster: ray start --head, or KubeRay's serveConfigV2)
# `args` is the graph-level spec and each stage's engine backend (see docs/configuration.md); the rest of each
# stage's settings is in its `deployments` entry (its spec as JSON in OMNI_SERVE_STAGE_SPEC): change them with
# `omni-serve build` and `serve deploy` the result; only the stages whose settings changed roll.
"""


def render(config: dict[str, Any], graph: str, path: str) -> str:
    import yaml

    from omni_serve import __version__

    return HEADER.format(graph=graph, path=path, version=__version__) + yaml.safe_dump(config, sort_keys=False)
