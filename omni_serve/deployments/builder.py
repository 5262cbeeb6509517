"""Turn a family and user values into a Ray Serve application: one deployment per stage, plus the ingress.

Contract: ``build_app(family, args)`` validates ``args`` against the family's spec (``Family.validate``: dotted
keys allowed, checkpoint checked and made absolute) over the family's defaults sized to the cluster
(``omni_serve.graph.sizing``), then binds one ``StageDeployment`` per stage the spec's
layout deploys (``GraphDef.deployed``), each with the options of its ``StageSpec`` (replicas or autoscaling,
CPUs/GPUs, resources, environment), and the ``OpenAIIngress`` with every stage's handle. Edges on the ``auto``
connector are resolved here, once, to a concrete backend that every replica then uses. An edge on an
in-process connector (``memory``) is refused: a served graph's stages are separate processes. A family's
``build_app(args)`` (its Serve import path) is this function bound to the family. Nothing here is specific to a
family: what to deploy is the graph declaration, how is the spec.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import BackpressureConfig

from omni_serve.graph.family import Family


def build_app(family: Family, args: dict[str, Any] | None = None) -> serve.Application:
    from omni_serve.deployments.stage import StageDeployment
    from omni_serve.graph.sizing import sized_spec

    spec, _ = sized_spec(family, args)  # defaults the user left unset sized to the cluster (and logged)
    spec = family.resolve_connectors(spec)  # one backend per edge for every replica
    spec_dict = spec.model_dump(mode="json")
    logging_config = spec.logging.model_dump()
    handles = {}
    for stage in family.graph.deployed(spec.layout()):
        options = spec.stage_spec(stage.name).deployment_options(stage.name, spec.ingress.request_timeout_s)
        handles[stage.name] = StageDeployment.options(**options, logging_config=logging_config).bind(
            family.path, stage.name, spec_dict)
    return ingress_deployment(spec.ingress, logging_config).bind(family.path, spec_dict, **handles)


def ingress_deployment(ing, logging_config: dict[str, Any]):
    """The ``OpenAIIngress`` deployment with the options of ``ing`` (an ``IngressSpec``), to bind."""
    from omni_serve.deployments.ingress import OpenAIIngress

    replicas = ({"autoscaling_config": ing.autoscaling_config} if ing.autoscaling_config
                else {"num_replicas": ing.num_replicas})
    return OpenAIIngress.options(
        name="ingress", max_ongoing_requests=ing.max_ongoing_requests,
        max_queued_requests=ing.max_queued_requests, max_surge_percent=ing.max_surge_percent,
        # a stopping ingress replica (redeploy, scale-down) finishes its streams: up to the request deadline
        graceful_shutdown_timeout_s=ing.request_timeout_s,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=ing.retry_after_s),
        ray_actor_options={"num_cpus": ing.num_cpus, **({"resources": dict(ing.resources)} if ing.resources else {})},
        logging_config=logging_config, **replicas,
    )
