"""Autoscaling policies for stage deployments, driven by the load each engine reports to Ray Serve.

Every stage replica reports its engine's ``load()`` through Serve's ``record_autoscaling_stats`` hook
(``omni_serve.deployments.stage``): ``load`` (utilization + backlog + admission queue: the demand on the
replica as a fraction of what it serves; > 1 means work is waiting), ``utilization`` (busy fraction of the
engine's worker), ``backlog``, ``queued``, ``active``, and per engine ``kv_used_fraction``,
``batch_occupancy``, ``running``/``waiting`` (autoregressive stages), ``ready`` and
``diffusion_steps_in_flight`` (batch stages; the DiT). Serve averages each over ``look_back_period_s``.

Policies (Ray Serve custom autoscaling policies; classes, so their parameters come from YAML as
``policy_kwargs``). Serve applies ``min_replicas``/``max_replicas``, ``upscale_delay_s``/
``downscale_delay_s`` and the scaling factors to what they return.

- ``EngineLoadPolicy`` (deployment level, the default of every stage with an ``autoscaling_config``):
  desired replicas = sum over the stage's replicas of ``metric`` / ``target_load``. With the default
  ``metric: load`` and ``target_load: 0.7`` a stage adds replicas once its replicas are busy more than 70% of
  the time, and gives them back when the load falls. Unlike Serve's default (ongoing requests), this
  scales only the stage that is the bottleneck: in a streaming graph every stage holds every request in
  flight, but only the bottleneck's worker is busy.
- ``StageRatioPolicy`` (application level, ``autoscaling_policy`` of the graph): the same per-stage
  decision, then ``ratios`` keep stage counts in proportion, e.g. ``{stage: talker, per: thinker,
  min: 0.5, max: 2}`` keeps talker replicas between half and twice the thinker's (a new thinker replica
  brings its talker along before the talker queue builds up). Stage-specific targets via
  ``stage_targets: {code2wav: 0.5}``. With ``speech``, a graph that admits audio streams by real-time
  capacity (``playback.admission``) scales on its queue too: the ingress reports ``speech_deficit``, the
  capacity its waiting streams lack as a fraction of what the graph has (``omni_serve.realtime_admission``),
  and each stage named in ``speech.stages`` is asked for at least (1 + deficit) times its current replicas
  (a deficit under ``min_deficit`` ignored; held for ``settle_s`` after the stage scaled up, since the capacity
  estimate rises only as streams are admitted on the new replicas; the ratios, applied after, still bound it).
  Admission holds the stages' load below what triggers ``target_load`` (it keeps every stream at
  ``1 + margin`` times real time), so without it a queue of streams never asks for a replica. The ingress
  needs an ``autoscaling_config`` to be in the application policy's view (``min_replicas: 1, max_replicas:
  1`` keeps it fixed); it is sized as Serve's default policy would, on its ongoing requests.

YAML (``args`` of a Serve config, or ``omni-serve build``)::

    stages:
      code2wav:
        autoscaling_config:
          min_replicas: 1
          max_replicas: 4
          upscale_delay_s: 5
          downscale_delay_s: 60
          policy:                       # optional: this is the default
            policy_function: omni_serve.autoscaling:EngineLoadPolicy
            policy_kwargs: {target_load: 0.7, metric: load}
    autoscaling_policy:                 # optional, application level (Serve config files only)
      policy_function: omni_serve.autoscaling:StageRatioPolicy
      policy_kwargs: {target_load: 0.7, ratios: [{stage: talker, per: thinker, min: 0.5, max: 2}],
                      speech: {ingress: ingress, stages: [code2wav, talker]}}
"""

from __future__ import annotations

import logging
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)

ENGINE_LOAD_POLICY = "omni_serve.autoscaling:EngineLoadPolicy"
STAGE_RATIO_POLICY = "omni_serve.autoscaling:StageRatioPolicy"


class EngineLoadParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target_load: float = Field(0.7, gt=0, description=(
        "Per-replica value of `metric` the stage is sized for: desired replicas = sum of the metric over "
        "the stage's replicas / target_load."))
    metric: str = Field("load", description=(
        "Engine signal to scale on: load (default), utilization, backlog, queued, active, kv_used_fraction, "
        "batch_occupancy, diffusion_steps_in_flight, ... (see the module docstring)."))


class StageRatio(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: str = Field(..., description="The stage whose replica count is bounded.")
    per: str = Field(..., description="The stage it is proportioned to.")
    min: float = Field(0.0, ge=0, description="At least ceil(min x replicas of `per`).")
    max: float | None = Field(None, gt=0, description="At most ceil(max x replicas of `per`) (None: no bound).")

    @model_validator(mode="after")
    def _ordered(self):
        if self.max is not None and self.max < self.min:
            raise ValueError(f"ratio {self.stage}/{self.per}: max {self.max} is below min {self.min}")
        if self.stage == self.per:
            raise ValueError(f"ratio of stage {self.stage!r} to itself")
        return self


class SpeechScaling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    ingress: str = Field("ingress", description="The deployment that admits audio streams and reports the deficit.")
    stages: list[str] = Field(default_factory=lambda: ["code2wav"], min_length=1, description=(
        "Stages asked for at least (1 + deficit) times their current replicas while streams wait: the stages "
        "that bound how many streams play in real time (code2wav, and the talker where it is the slower)."))
    min_deficit: float = Field(0.1, ge=0, description=(
        "A deficit below this is ignored (Serve rounds any fraction of a replica up to a whole one)."))
    settle_s: float = Field(60.0, ge=0, description=(
        "After a speech stage scaled up, its floor holds at what was asked for this long before the deficit "
        "raises it again: the capacity estimate rises only as streams are admitted, one at a time, on the new "
        "replicas, so a deficit measured before that would ask again for what is already coming."))


class StageRatioParams(EngineLoadParams):
    stage_targets: dict[str, float] = Field(default_factory=dict, description=(
        "target_load per stage, overriding target_load for the stages named."))
    ratios: list[StageRatio] = Field(default_factory=list, description="Replica ratios kept between stages.")
    speech: SpeechScaling | None = Field(None, description=(
        "Scale the stages that bound speech on the admission queue (the ingress' speech_deficit)."))


class EngineLoadPolicy:
    """Deployment-level policy: size the stage so each replica runs at ``target_load`` of ``metric``."""

    def __init__(self, **kwargs: Any):
        self.params = EngineLoadParams.model_validate(kwargs)

    def desired(self, ctx, target_load: float | None = None) -> float | None:
        """Replicas wanted by the reported metric, or None while no replica has reported it yet."""
        values = (ctx.aggregated_metrics or {}).get(self.params.metric)
        if not values:
            return None
        return sum(values.values()) / (target_load or self.params.target_load)

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        desired = self.desired(ctx)
        if desired is None:  # replicas starting, or an engine without load reports: hold
            return ctx.target_num_replicas, {}
        return desired, {}


class StageRatioPolicy:
    """Application-level policy: per-stage ``EngineLoadPolicy`` decisions, then ``ratios`` between stages."""

    def __init__(self, **kwargs: Any):
        self.params = StageRatioParams.model_validate(kwargs)
        self._load = EngineLoadPolicy(target_load=self.params.target_load, metric=self.params.metric)
        self._warned: set[str] = set()

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        by_stage = {dep_id.name: dep_id for dep_id in contexts}
        desired: dict[Any, float] = {}
        speech = self.params.speech
        for dep_id, ctx in contexts.items():
            if speech is not None and dep_id.name == speech.ingress:
                from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

                desired[dep_id] = replica_queue_length_autoscaling_policy(ctx)[0]
                continue
            wanted = self._load.desired(ctx, self.params.stage_targets.get(dep_id.name))
            desired[dep_id] = ctx.target_num_replicas if wanted is None else wanted
        if speech is not None:
            self._speech(speech, contexts, by_stage, desired)
        for ratio in self.params.ratios:
            missing = {ratio.stage, ratio.per} - by_stage.keys()
            if missing:
                key = ",".join(sorted(missing))
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("autoscaling ratio %s/%s ignored: %s not autoscaled in this application",
                                ratio.stage, ratio.per, key)
                continue
            stage, base = by_stage[ratio.stage], math.ceil(desired[by_stage[ratio.per]])
            low = math.ceil(ratio.min * base)
            high = math.inf if ratio.max is None else max(low, math.ceil(ratio.max * base))
            desired[stage] = min(max(desired[stage], low), high)
        return desired, {}

    def _speech(self, speech: SpeechScaling, contexts: dict, by_stage: dict, desired: dict) -> None:
        """At least (1 + deficit) times the current replicas of each speech stage while streams wait, held for
        ``settle_s`` after the stage scaled up. The ratios, applied after, still bound it."""
        missing = {speech.ingress, *speech.stages} - by_stage.keys()
        if missing:
            key = "speech:" + ",".join(sorted(missing))
            if key not in self._warned:
                self._warned.add(key)
                log.warning("speech autoscaling ignores %s: not autoscaled in this application (give it an "
                            "autoscaling_config)", ", ".join(sorted(missing)))
        ingress = by_stage.get(speech.ingress)
        deficits = (contexts[ingress].aggregated_metrics or {}).get("speech_deficit") if ingress else None
        if not deficits:
            return
        deficit = sum(deficits.values()) / len(deficits)  # each ingress replica's share of the streams
        if deficit <= 0 or deficit < speech.min_deficit:
            return
        for name in speech.stages:
            if name in by_stage:
                ctx = contexts[by_stage[name]]
                settling = (ctx.last_scale_up_time is not None
                            and ctx.current_time - ctx.last_scale_up_time < speech.settle_s)
                floor = ctx.target_num_replicas if settling else ctx.current_num_replicas * (1 + deficit)
                desired[by_stage[name]] = max(desired[by_stage[name]], floor)


def check_policy(policy: dict[str, Any], *, application: bool) -> None:
    """Validate the kwargs of an omni_serve policy early (a typo fails the spec, not the Serve controller)."""
    function = policy.get("policy_function")
    kwargs = policy.get("policy_kwargs") or {}
    if function == ENGINE_LOAD_POLICY:
        EngineLoadParams.model_validate(kwargs)
    elif function == STAGE_RATIO_POLICY:
        if not application:
            raise ValueError(f"{STAGE_RATIO_POLICY} is an application-level policy: set it as the graph's "
                             "autoscaling_policy, not in a stage's autoscaling_config")
        StageRatioParams.model_validate(kwargs)
