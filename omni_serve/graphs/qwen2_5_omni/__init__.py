"""Qwen2.5-Omni as a Ray Serve stage graph: encoder -> thinker -> talker -> code2wav, plus the ingress.

``build_app(args)`` validates ``args`` against ``OmniGraphSpec`` (dotted keys allowed) and returns the
application with the stages of the spec's thinker layout: ``thinker``, or ``thinker_prefill`` +
``thinker_decode`` with ``thinker_layout=disaggregated``. Works as ``serve run
omni_serve.graphs.qwen2_5_omni:build_app checkpoint=DIR`` and from a Serve config file
(``applications[].import_path`` + ``args``); see ``omni_serve/configs/qwen2_5_omni.yaml`` and
``qwen2_5_omni_disagg.yaml``.
"""

from __future__ import annotations

from typing import Any

from ray import serve

from omni_serve.graphs.app import build_graph_app, validate_spec
from omni_serve.graphs.qwen2_5_omni.spec import OmniGraphSpec

STAGE_RUNNERS = {
    "encoder": "omni_serve.graphs.qwen2_5_omni.stages:EncoderRunner",
    "thinker": "omni_serve.graphs.qwen2_5_omni.stages:ThinkerRunner",
    "thinker_prefill": "omni_serve.graphs.qwen2_5_omni.stages:ThinkerPrefillRunner",
    "thinker_decode": "omni_serve.graphs.qwen2_5_omni.stages:ThinkerDecodeRunner",
    "talker": "omni_serve.graphs.qwen2_5_omni.stages:TalkerRunner",
    "code2wav": "omni_serve.graphs.qwen2_5_omni.stages:Code2WavRunner",
}
FRONTEND = "omni_serve.graphs.qwen2_5_omni.frontend:OmniFrontend"


def build_spec(args: dict[str, Any] | None) -> OmniGraphSpec:
    """Validate ``args``; the checkpoint path is made absolute so every replica finds it whatever its cwd."""
    return validate_spec(OmniGraphSpec, args, "config.json",
                         "write one with `omni-serve make-checkpoint qwen2_5_omni --size tiny DIR`")


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    spec = build_spec(args)
    return build_graph_app(spec, {stage: STAGE_RUNNERS[stage] for stage in spec.deployed_stages()}, FRONTEND)
