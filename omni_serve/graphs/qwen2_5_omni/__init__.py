"""Qwen2.5-Omni as a Ray Serve stage graph: encoder -> thinker -> talker -> code2wav, plus the ingress.

``build_app(args)`` validates ``args`` against ``OmniGraphSpec`` (dotted keys allowed) and returns the
application. Works as ``serve run omni_serve.graphs.qwen2_5_omni:build_app checkpoint=DIR`` and from a Serve
config file (``applications[].import_path`` + ``args``); see ``omni_serve/configs/qwen2_5_omni.yaml``.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from omni_serve.graphs.qwen2_5_omni.spec import OmniGraphSpec
from omni_serve.graphs.spec import apply_overrides

STAGE_RUNNERS = {
    "encoder": "omni_serve.graphs.qwen2_5_omni.stages:EncoderRunner",
    "thinker": "omni_serve.graphs.qwen2_5_omni.stages:ThinkerRunner",
    "talker": "omni_serve.graphs.qwen2_5_omni.stages:TalkerRunner",
    "code2wav": "omni_serve.graphs.qwen2_5_omni.stages:Code2WavRunner",
}


def build_spec(args: dict[str, Any] | None) -> OmniGraphSpec:
    """Validate ``args``; the checkpoint path is made absolute so every replica finds it whatever its cwd."""
    spec = OmniGraphSpec.model_validate(apply_overrides(dict(args or {})))
    checkpoint = os.path.abspath(os.path.expanduser(spec.checkpoint))
    if not os.path.isfile(os.path.join(checkpoint, "config.json")):
        raise ValueError(f"checkpoint {spec.checkpoint!r} is not a checkpoint directory (no config.json); "
                         "write one with `omni-serve make-checkpoint qwen2_5_omni --size tiny DIR`")
    return spec.model_copy(update={"checkpoint": checkpoint})


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    from omni_serve.deployments.ingress import OpenAIIngress
    from omni_serve.deployments.stage import StageDeployment

    spec = build_spec(args)
    spec_dict = spec.model_dump(mode="json")
    handles = {}
    for stage, runner in STAGE_RUNNERS.items():
        options = getattr(spec.stages, stage).deployment_options(stage)
        handles[stage] = StageDeployment.options(**options).bind(stage, runner, spec_dict)
    ing = spec.ingress
    return OpenAIIngress.options(
        name="ingress", num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests,
        ray_actor_options={"num_cpus": ing.num_cpus},
    ).bind("omni_serve.graphs.qwen2_5_omni.frontend:OmniFrontend",
           "omni_serve.graphs.qwen2_5_omni.spec:OmniGraphSpec", spec_dict, **handles)
