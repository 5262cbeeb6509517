"""What the ingress' admission by real-time capacity reads of the stages: each stage's CPU use and replicas, and the
cluster's CPUs.

Contract: ``StageCpuReader(handles)`` over the ingress' stage handles (stage name -> Serve ``DeploymentHandle``);
``await reader()`` returns ``(stages, cores)``: a ``StageCpu`` per stage (its replicas' ``StageDeployment.cpu_use``
in all, with the running replicas its handle routes to), or None when a stage does not report its use (a stage on
an accelerator, an engine computing in other processes: vLLM), and the cluster's CPUs (Ray's count, read at most
every ``CORES_TTL_S``). ``RealtimeAdmission.cpu_source`` takes it; the admission projects the use to one more
stream (``omni_serve.realtime_projection``).

A handle routes a call to one replica, and Serve's router prefers the replica with the fewest calls in flight: asked
once, a stage of two replicas with one stream would answer from its idle one. So a stage of several replicas is
asked ``CALLS_PER_REPLICA`` times as many times as it has replicas, all at once (each call in flight steers the next
elsewhere), and the answers of the distinct replicas (by process id) are added up; replicas no call reached (rare)
count as the mean of those that answered.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping

from omni_serve.deployments.availability import running_replicas
from omni_serve.realtime_projection import StageCpu

CORES_TTL_S = 10.0  # the cluster's CPU count changes only when nodes come and go
CALLS_PER_REPLICA = 2
FIELDS = ("per_s", "engine_per_s", "fixed_per_s", "threads")


class StageCpuReader:
    def __init__(self, handles: Mapping[str, Any]):
        self.handles = dict(handles)
        self._cores, self._cores_at = 0.0, -CORES_TTL_S

    async def __call__(self) -> tuple[list[StageCpu] | None, float]:
        stages = await asyncio.gather(*(self._stage(name, handle) for name, handle in self.handles.items()))
        return (None if any(s is None for s in stages) else list(stages)), self.cores()

    async def _stage(self, name: str, handle: Any) -> StageCpu | None:
        replicas = running_replicas(handle) or 1
        calls = 1 if replicas == 1 else CALLS_PER_REPLICA * replicas
        answers = await asyncio.gather(*(handle.cpu_use.remote() for _ in range(calls)))
        if any(a is None for a in answers):
            return None
        distinct = list({a.get("pid", i): a for i, a in enumerate(answers)}.values())
        mean = {f: sum(a.get(f, 1.0 if f == "threads" else 0.0) for a in distinct) / len(distinct) for f in FIELDS}
        total = {f: mean[f] * max(replicas, len(distinct)) for f in FIELDS}
        return StageCpu(name, total["per_s"], total["fixed_per_s"], replicas, mean["threads"], total["engine_per_s"])

    def cores(self) -> float:
        now = time.monotonic()
        if now - self._cores_at >= CORES_TTL_S:
            import ray

            self._cores, self._cores_at = float(ray.cluster_resources().get("CPU", 0.0)), now
        return self._cores
