"""What the ingress' admission by real-time capacity reads of the stages: each stage's CPU use and replicas, and the
cluster's CPUs.

Contract: ``StageCpuReader(handles)`` over the ingress' stage handles (stage name -> Serve ``DeploymentHandle``);
``await reader()`` returns ``(stages, cores)``: a ``StageCpu`` per stage (its replicas' ``StageDeployment.cpu_use``
in all, with the running replicas its handle routes to), or None when a stage does not report its use (a stage on
an accelerator or on several ranks, an engine computing in other processes: vLLM), and the cluster's CPUs (Ray's
count, read at most every ``CORES_TTL_S``). A stage with no running replica spends nothing and is not called (a
call would wait for a replica, or wake a stage scaled to zero). A read that takes over ``TIMEOUT_S`` raises
``TimeoutError``. ``RealtimeAdmission.cpu_source`` takes it; the admission projects the use to one more stream
(``omni_serve.realtime_projection``).

A handle routes a call to one replica, and Serve's router picks the less busy of two it samples: asked once, a stage
of two replicas with one stream would answer from its idle one at least half the time. So a stage of several
replicas is asked ``CALLS_PER_REPLICA`` times as many times as it has replicas, all at once (each call in flight
steers the next elsewhere), and the answers of the distinct replicas (by node and process) are added up; replicas
no call reached (rare) count as the mean of those that answered.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping

from omni_serve.deployments.availability import running_replicas
from omni_serve.realtime_projection import StageCpu

CORES_TTL_S = 10.0  # the cluster's CPU count changes only when nodes come and go
CALLS_PER_REPLICA = 2
TIMEOUT_S = 2.0  # a stage that does not answer (busy, being replaced): the reading is not known, not stale
FIELDS = ("per_s", "engine_per_s", "fixed_per_s")


class StageCpuReader:
    def __init__(self, handles: Mapping[str, Any]):
        self.handles = dict(handles)
        self._cores, self._cores_at = 0.0, -CORES_TTL_S

    async def __call__(self) -> tuple[list[StageCpu] | None, float]:
        reads = (self._stage(name, handle) for name, handle in self.handles.items())
        stages = await asyncio.wait_for(asyncio.gather(*reads), TIMEOUT_S)
        return (None if any(s is None for s in stages) else list(stages)), await self.cores()

    async def _stage(self, name: str, handle: Any) -> StageCpu | None:
        replicas = running_replicas(handle)
        if replicas == 0:
            return StageCpu(name, 0.0, 0.0, 0, 0.0)
        replicas = replicas or 1  # not known yet: at least the one that answers
        calls = 1 if replicas == 1 else CALLS_PER_REPLICA * replicas
        answers = await asyncio.gather(*(handle.cpu_use.remote() for _ in range(calls)))
        if any(a is None for a in answers):
            return None
        distinct = list({(a.get("node_id"), a.get("pid", i)): a for i, a in enumerate(answers)}.values())
        replicas = max(replicas, len(distinct))
        total = {f: sum(a.get(f, 0.0) for a in distinct) / len(distinct) * replicas for f in FIELDS}
        return StageCpu(name, total["per_s"], total["fixed_per_s"], replicas, total["engine_per_s"])

    async def cores(self) -> float:
        now = time.monotonic()
        if now - self._cores_at >= CORES_TTL_S:
            import ray

            # a GCS round trip: off the ingress' event loop
            self._cores = float((await asyncio.to_thread(ray.cluster_resources)).get("CPU", 0.0))
            self._cores_at = now
        return self._cores
