"""Real-time capacity projected from what the stages spend of the CPU: would the graph still produce every admitted
stream, and one more, at least ``1 + margin`` times as fast as they play?

Contract: ``StageCpu`` is one stage as its replicas report it (``StageDeployment.cpu_use``: their CPU seconds per
second, the part of it in the engines' steps and the part of those fixed per step) with its running replicas.
``project(stages, streams, speed, cores, new_streams, new_speed, opening_speed)`` returns a ``Projection``: the CPU
each stage and the graph would use with ``new_streams`` streams each produced at ``new_speed`` audio seconds per
second (one of them opening at ``opening_speed``), from ``streams`` at ``speed`` now, and whether that fits
``cores``. ``RealtimeAdmission`` admits by it where every stage reports its
use (docs/speech_under_load.md).

The model. A stage's CPU use splits into a part fixed per step (a step's fixed cost times the steps per second:
weights read, kernels launched, one per batched call whatever its size) and the rest, which grows with the rows of
each step. The engines batch the streams into shared steps, so the steps per second follow each stream's speed,
not their number: the fixed part scales with the speed, the rest with the audio produced in all (streams times
speed). Projected, for a stage whose replicas spend ``fixed + rest`` in all (the streams spread evenly over its
replicas, each replica with a stream paying its own fixed part):

    cpu' = fixed / B * (v' / v) * B' + rest * (n' * v') / (n * v)

with ``n``, ``v`` the streams and their speed now, ``n'``, ``v'`` the projected ones (with a stream that opens at
``o``: the steps at ``max(v', o)``, the audio ``(n' - 1) * v' + o``), ``B`` and ``B'`` the replicas with a stream now
and then (at most one per stream). It fits when every replica's engine thread (the CPU of its steps, projected the
same way) needs at most one CPU (an engine computes one step at a time on that thread; the rest of the process,
moving payloads on its event loop, and torch's other threads run beside it) and the stages' in all at most the
cluster's CPUs less ``RESERVE_CPUS`` (the processes no stage reports: the ingress, Serve's proxy and controller,
Ray's own).

Why CPU seconds, not the steps' wall time: the stages of a node share its cores, and a step timed while another
stage computes reads longer than its cost; CPU seconds add up across stages to what the cores must give. Why this
and not the audio delivered per second alone: batching makes one more stream cost less than the streams' average
(the fixed part does not grow), and the cores the stages share make it cost more than the delivered rate suggests
once they are all busy; the delivered rate divided by one more stream gets both wrong.

What it does not see: a stream's start beyond ``opening_speed`` (its prefill, its first chunks made as fast as the
stages go; admission's ``guard_s`` covers part of it), and steps that are not shared (streams whose chunks fall in
separate calls pay the fixed part more than once: the estimate leans optimistic there, which the margin covers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

RESERVE_CPUS = 0.25  # CPU the processes no stage reports use on a busy node (ingress, proxy, controller, raylet)
MIN_SPEED = 0.05  # below this delivered speed the streams are not being produced: nothing to project from


@dataclass(frozen=True)
class StageCpu:
    stage: str
    per_s: float  # its replicas' process CPU seconds per second now, in all
    fixed_per_s: float  # of it, the part fixed per step
    replicas: int = 1
    engine_per_s: float | None = None  # of per_s, the engines' worker threads in their steps; None: all of it


@dataclass
class Projection:
    load: float  # the projected need over what fits at the tightest bound (an engine thread, or the cores): <= 1 fits
    total_cpus: float  # the stages' projected CPU seconds per second in all
    cores: float  # what they may use
    per_replica: dict[str, float] = field(default_factory=dict)  # stage -> one replica's projected CPU
    bound: str = "cores"  # the tightest bound: a stage's name (its replicas' engine threads), or "cores"

    @property
    def fits(self) -> bool:
        return self.load <= 1.0

    def describe(self) -> str:
        worst = ", ".join(f"{s} {c:.2f}" for s, c in sorted(self.per_replica.items(), key=lambda kv: -kv[1])[:3])
        return f"projected CPU {self.total_cpus:.2f} of {self.cores:.2f} (per replica: {worst})"


def project(stages: list[StageCpu], streams: int, speed: float, cores: float, new_streams: int,
            new_speed: float, opening_speed: float | None = None) -> Projection | None:
    """The projection of ``stages`` from ``streams`` produced at ``speed`` each to ``new_streams`` at ``new_speed``
    on ``cores`` CPUs (the module docstring's model); with ``opening_speed``, one of them is produced at that speed
    instead, or at ``new_speed`` if faster (a stream that opens: its first chunks must come well ahead of real time,
    and the shared steps go at its pace). None when there is nothing to project from (no stream, streams produced
    slower than ``MIN_SPEED``) or the cluster's CPUs are unknown (no more than ``RESERVE_CPUS``)."""
    budget = cores - RESERVE_CPUS
    if streams <= 0 or speed < MIN_SPEED or new_streams <= 0 or budget <= 0:  # budget: the cluster's CPUs unknown
        return None
    per_replica, total, tightest = {}, 0.0, (0.0, "cores")
    fastest, audio = new_speed, new_streams * new_speed
    if opening_speed is not None:
        opening = max(new_speed, opening_speed)  # a stream that opens goes at least as fast as the others
        fastest, audio = opening, audio - new_speed + opening
    more_speed, more_audio = fastest / speed, audio / (streams * speed)
    for s in stages:
        replicas = max(1, s.replicas)
        busy_now, busy = min(replicas, streams), min(replicas, new_streams)  # replicas with a stream: the rest idle
        per_s = max(s.per_s, 0.0)
        fixed = min(max(s.fixed_per_s, 0.0), per_s)
        engine = per_s if s.engine_per_s is None else min(max(s.engine_per_s, fixed), per_s)
        fixed_each = fixed / busy_now * more_speed  # each busy replica pays its own fixed part, at the new speed
        cpu = fixed_each * busy + (per_s - fixed) * more_audio
        engine_each = fixed_each + (engine - fixed) * more_audio / busy
        per_replica[s.stage] = cpu / busy
        total += cpu
        tightest = max(tightest, (engine_each, s.stage))  # an engine thread spends at most one CPU second per second
    tightest = max(tightest, (total / budget, "cores"))
    return Projection(tightest[0], total, budget, per_replica, tightest[1])
