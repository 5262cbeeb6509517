"""Qwen2.5-Omni's defaults sized to the cluster (``omni_serve.graph.sizing``): one code2wav replica per CPU its
engine threads fill, up to ``MAX_CODE2WAV_REPLICAS``.

Why code2wav: a speech reply's cost is mostly code2wav's (a DiT solved ``num_steps`` times per window, then
BigVGAN), and one replica computes one call at a time on its engine thread. The thinker idles after its prefill and
the talker's steps are short, so on a machine whose cores the AR stages leave idle most of the time, code2wav
replicas are what turns cores into audio. Measured on two cores (docs/benchmarks.md#defaults-sized-to-the-cluster):
two one-thread replicas against one, at 16 streams. Above eight the rule stops: that is not measured, and each
replica holds its own copy of the weights.

The replicas must also fit the CPUs the graph reserves (``num_cpus``, Ray's logical CPUs): at most as many as the
cluster's CPUs left by the other stages and the ingress (each at its replica count, or its autoscaling minimum)
hold at code2wav's ``num_cpus`` each, and at least one.

Left as set: a code2wav stage with an ``autoscaling_config`` (its replicas are the policy's), on an accelerator or
reserving GPUs (one replica per device is the user's choice), or placed by custom ``resources`` (the replicas that
fit are those of the nodes that declare them, not of the whole cluster). Qwen3-Omni has no rule: its code2wav is a
light ConvNet, and two one-thread replicas measured slower than one there.
"""

from __future__ import annotations

from typing import Any

from omni_serve.graph.sizing import ClusterShape

MAX_CODE2WAV_REPLICAS = 8


def _replicas(num_replicas: int | None, autoscaling_config: dict | None) -> int:
    """A deployment's replicas for the reservation: its fixed count, or its autoscaling minimum."""
    return autoscaling_config.get("min_replicas", 1) if autoscaling_config else num_replicas


def _reserved_cpus(stage) -> float:
    """CPUs a stage reserves, its parallel ranks' bundles included."""
    rank_cpus, _ = stage.parallel.rank_resources(stage.num_cpus, stage.num_gpus)
    per_replica = stage.num_cpus + (stage.parallel.ranks - 1) * rank_cpus
    return _replicas(stage.num_replicas, stage.autoscaling_config) * per_replica


def size_to_cluster(spec, shape: ClusterShape) -> dict[str, Any]:
    code2wav = spec.stages.code2wav
    if code2wav.autoscaling_config or code2wav.engine.device != "cpu" or code2wav.resources or code2wav.num_gpus:
        return {}
    replicas = int(shape.cpus // code2wav.engine.torch_threads)
    if code2wav.num_cpus > 0:
        ingress = spec.ingress
        others = (ingress.num_cpus * _replicas(ingress.num_replicas, ingress.autoscaling_config)
                  + sum(_reserved_cpus(spec.stage_spec(name)) for name in spec.deployed_stages() if name != "code2wav"))
        replicas = min(replicas, int((shape.cpus - others) / code2wav.num_cpus + 1e-9))
    return {"stages": {"code2wav": {"num_replicas": max(1, min(MAX_CODE2WAV_REPLICAS, replicas))}}}
