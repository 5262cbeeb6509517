"""Qwen2.5-Omni's defaults sized to the cluster (``omni_serve.graph.sizing``): one code2wav replica per CPU its
engine threads fill, up to ``MAX_CODE2WAV_REPLICAS``.

Why code2wav: a speech reply's cost is mostly code2wav's (a DiT solved ``num_steps`` times per window, then
BigVGAN), and one replica computes one call at a time on its engine thread. The thinker idles after its prefill and
the talker's steps are short, so on a machine whose cores the AR stages leave idle most of the time, code2wav
replicas are what turns cores into audio. Measured on two cores (docs/benchmarks.md#defaults-sized-to-the-cluster):
two one-thread replicas against one, at 16 streams. Above eight the rule stops: that is not measured, and each
replica holds its own copy of the weights.

Left as set: a code2wav stage with an ``autoscaling_config`` (its replicas are the policy's), on an accelerator
(one replica per device is the user's choice) or placed by custom ``resources`` (the replicas that fit are those
of the nodes that declare them, not of the whole cluster). Qwen3-Omni has no rule: its code2wav is a light ConvNet, and two
one-thread replicas measured slower than one there.
"""

from __future__ import annotations

from typing import Any

from omni_serve.graph.sizing import ClusterShape

MAX_CODE2WAV_REPLICAS = 8


def size_to_cluster(spec, shape: ClusterShape) -> dict[str, Any]:
    code2wav = spec.stages.code2wav
    if code2wav.autoscaling_config or code2wav.engine.device != "cpu" or code2wav.resources:
        return {}
    replicas = max(1, min(MAX_CODE2WAV_REPLICAS, int(shape.cpus // code2wav.engine.torch_threads)))
    return {"stages": {"code2wav": {"num_replicas": replicas}}}
