"""Several graphs behind one ingress, as one Serve application: a voice product's speech and transcription models in
one release.

Contract: ``build_app(args)`` (``serve run omni_serve.deployments.combined:build_app``, or a Serve config's
``import_path``) takes ``CombinedSpec``'s values: ``graphs`` (family name -> that graph's values, each validated by
its family's spec as ``omni-serve serve`` would, over its defaults sized to the cluster), and the ``ingress``,
``data_plane`` and ``logging`` every graph shares. Each graph's stages deploy as their own Serve deployments, named
``<family>-<stage>`` (each scales on its own load, as in a graph's own app); one ``OpenAIIngress`` serves every
graph's routes (``omni_serve.deployments.frontends``): a path two graphs serve goes to the graph whose
``model_name`` the request's ``model`` names. A graph's values may not set what the graphs share (its ``ingress``,
``data_plane``, ``logging``) nor an app-level ``autoscaling_policy`` (it scales one graph's stages by their names);
the graphs' model names must differ. ``validate(args)`` checks all of it without Ray.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_serve.graph.spec import DataPlaneSpec, IngressSpec, LoggingSpec, apply_overrides

SHARED = ("ingress", "data_plane", "logging")


class CombinedSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    graphs: dict[str, dict[str, Any]] = Field(..., min_length=1, description=(
        "Family name -> that graph's values (its spec's fields: checkpoint, model_name, stages, edges, ...), each "
        "validated by its family's spec."))
    ingress: IngressSpec = Field(default_factory=IngressSpec, description="The one HTTP ingress deployment.")
    data_plane: DataPlaneSpec = Field(default_factory=DataPlaneSpec, description="Data-plane settings, every graph.")
    logging: LoggingSpec = Field(default_factory=LoggingSpec, description="Logging of every deployment.")

    @field_validator("graphs")
    @classmethod
    def _graphs(cls, graphs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from omni_serve.graph.registry import families

        known = families()
        for name, values in graphs.items():
            if name not in known:
                raise ValueError(f"unknown graph {name!r}; the registry has {', '.join(sorted(known))}")
            values = apply_overrides(dict(values or {}))
            shared = [k for k in (*SHARED, "autoscaling_policy") if k in values]
            if shared:
                raise ValueError(f"graphs.{name} sets {shared}: the graphs of a combined app share the top-level "
                                 "ingress, data_plane and logging, and take no app-level autoscaling_policy")
            graphs[name] = values
        return graphs


def validate(args: dict[str, Any] | None) -> tuple[CombinedSpec, list]:
    """(the combined spec, [(family, its graph spec), ...]) of ``args``; ``ValueError`` for a bad one."""
    from omni_serve.graph.registry import families

    spec = CombinedSpec.model_validate(apply_overrides(dict(args or {})))
    shared = {k: getattr(spec, k).model_dump(mode="json") for k in SHARED}
    out = []
    for name, values in spec.graphs.items():
        family = families()[name]
        out.append((family, family.validate({**values, **shared})))
    names = [s.model_name for _, s in out]
    if len(set(names)) != len(names):
        raise ValueError(f"the graphs' model names must differ (requests choose a graph by model): {names}")
    return spec, out


def build_app(args: dict[str, Any] | None = None):
    from omni_serve.deployments.builder import ingress_deployment
    from omni_serve.deployments.stage import StageDeployment
    from omni_serve.graph.sizing import sized_spec

    combined, graphs = validate(args)
    shared = {k: getattr(combined, k).model_dump(mode="json") for k in SHARED}
    logging_config = combined.logging.model_dump()
    handles, paths, specs = {}, [], []
    for family, _ in graphs:
        spec, _ = sized_spec(family, {**combined.graphs[family.name], **shared})
        spec = family.resolve_connectors(spec)
        spec_dict = spec.model_dump(mode="json")
        for stage in family.graph.deployed(spec.layout()):
            options = spec.stage_spec(stage.name).deployment_options(f"{family.name}-{stage.name}",
                                                                     combined.ingress.request_timeout_s)
            handles[f"{family.name}/{stage.name}"] = StageDeployment.options(
                **options, logging_config=logging_config).bind(family.path, stage.name, spec_dict)
        paths.append(family.path)
        specs.append(spec_dict)
    return ingress_deployment(combined.ingress, logging_config).bind(paths, specs, **handles)
