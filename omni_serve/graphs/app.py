"""Turn a graph (spec class + stage runners + frontend) into a Ray Serve application.

Contract: ``validate_spec(spec_cls, args, marker, hint)`` validates user values (dotted keys allowed) and
makes the checkpoint path absolute after checking that ``marker`` exists in it; ``build_graph_app(spec,
stage_runners, frontend)`` binds one ``StageDeployment`` per stage (options from the stage's
``StageSpec``) and the ingress, which gets every stage's handle. Graph modules only declare *what* their
stages are; deployment options always come from the spec.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel
from ray import serve
from ray.serve.config import BackpressureConfig

from omni_serve.graphs.spec import apply_overrides


def validate_spec(spec_cls: type[BaseModel], args: dict[str, Any] | None, marker: str, hint: str):
    spec = spec_cls.model_validate(apply_overrides(dict(args or {})))
    checkpoint = os.path.abspath(os.path.expanduser(spec.checkpoint))
    if not os.path.isfile(os.path.join(checkpoint, marker)):
        raise ValueError(f"checkpoint {spec.checkpoint!r} is not a checkpoint directory (no {marker}); {hint}")
    return spec.model_copy(update={"checkpoint": checkpoint})


def _qualified(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def build_graph_app(spec: BaseModel, stage_runners: dict[str, str], frontend: str) -> serve.Application:
    from omni_serve.deployments.ingress import OpenAIIngress
    from omni_serve.deployments.stage import StageDeployment

    spec_dict = spec.model_dump(mode="json")
    logging_config = spec.logging.model_dump()
    handles = {}
    for stage, runner in stage_runners.items():
        options = getattr(spec.stages, stage).deployment_options(stage)
        handles[stage] = StageDeployment.options(**options, logging_config=logging_config).bind(
            stage, runner, spec_dict)
    ing = spec.ingress
    replicas = ({"autoscaling_config": ing.autoscaling_config} if ing.autoscaling_config
                else {"num_replicas": ing.num_replicas})
    return OpenAIIngress.options(
        name="ingress", max_ongoing_requests=ing.max_ongoing_requests,
        max_queued_requests=ing.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=503, retry_after_s=ing.retry_after_s),
        ray_actor_options={"num_cpus": ing.num_cpus}, logging_config=logging_config, **replicas,
    ).bind(frontend, _qualified(type(spec)), spec_dict, **handles)
