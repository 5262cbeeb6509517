"""The one generic stage deployment: hosts one stage of a family's graph on the engine its runner makes.

Contract: ``StageDeployment(family, stage, graph_spec)`` loads the family (``module:FAMILY``), validates the spec
and builds the stage's declared runner (loading only that stage's weights) and engine. It serves:
- ``generate(call)``: a streaming call; ``call`` is the stage's declared call message, and it yields the stage's
  declared outputs for one request (``StageRunner.handle`` checks both). Cancelling the call (client gone,
  ingress error) aborts the request in the engine and frees its state; so does the ingress marking the request
  abandoned, for a call whose cancel got lost (``omni_serve.graph.abandoned``).
- ``ready()``: cheap liveness/identity probe used by the ingress' ``/health``: the node (id and IP) it runs on,
  the last streams the ``nearest`` connector routed here (edge, backend, producer and reader nodes), the engine's stats
  (active requests; for AR stages running/waiting requests and KV block counts) and, under
  ``data_plane``, the counters of the connectors this replica uses (payloads held, buffer use),
  ``abandoned_calls_cancelled`` (calls it cancelled because their request was abandoned), and under
  ``kernels`` what this replica's CPU runs (``omni_kernels.cpu_capability``: ISA, bfloat16/prepacked support) and
  which implementation each of its bfloat16/prepacked paths took, with the reason for a fallback
  (``omni_kernels.kernel_paths``).
- ``record_autoscaling_stats()``: Ray Serve's custom-metrics hook, the engine's ``load()`` (utilization,
  backlog, queued, KV use, batch occupancy, diffusion steps in flight); the ``omni_serve.autoscaling``
  policies scale the stage on them.
- ``cpu_use()``: what the replica's process spends of the CPU (``Engine.cpu_use``: CPU seconds per second, the part
  in the engine's steps, the part fixed per step) with its node and process; None for an engine that does not
  report it, a stage on an accelerator, or a stage on several ranks (the others compute in their own processes).
  The ingress' admission by real-time capacity projects it to more streams (``omni_serve.realtime_projection``).
- ``parameter_names()``: names of the parameters this replica holds (for tests and operators).
Ray Serve calls ``check_health`` periodically; a dead engine thread, or a step running longer than the stage's
``max_step_s`` (a hung engine), marks the replica unhealthy and Serve replaces it. The
replica exports its engine's metrics (``omni_serve.metrics.StageMetrics``) and its data-plane transfers.

Shutdown (the stage's ``graceful_shutdown_timeout_s``, by default the request deadline, passed to Serve): Serve stops routing calls to a stopping
replica, waits for the calls in flight, then calls ``__del__``, which drains the engine (``Engine.drain``: a request
still there or arriving late is refused or, past the same deadline, aborted with ``Draining``, a 503 at the
ingress), cleans it up and closes the replica's data-plane connectors (what it put and nobody freed goes with
them: a free of a request can reach another replica of the stage). Serve kills the replica ``graceful_shutdown_timeout_s`` after the stop began, whatever
is still running.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any, AsyncIterator

from ray import serve

from omni_serve.graph.abandoned import AbandonedCalls
from omni_serve.graph.calls import free_within
from omni_serve.graph.messages import Message

log = logging.getLogger(__name__)


@serve.deployment
class StageDeployment:
    async def __init__(self, family: str, stage: str, graph_spec: dict[str, Any]):
        import torch

        from omni_serve.graph.registry import load_family
        from omni_serve.graph.runner import build_runner
        from omni_serve.graph.stage_settings import own_stage
        from omni_serve.metrics import StageMetrics, observe_transfers
        from omni_serve.transport.connectors import keep_node_tidy

        self.stage = stage
        # a Serve config file carries this stage's settings in its own deployment entry (stage_settings)
        self.runner = build_runner(load_family(family), stage, own_stage(graph_spec, stage))
        torch.set_num_threads(self.runner.engine_spec.torch_threads)
        self.engine = self.runner.make_engine()
        # Started here, so an engine that cannot start (e.g. vLLM without room for its KV cache) fails the
        # deployment with its error instead of failing every request.
        await self.engine.start()
        self.metrics = StageMetrics(stage, self.engine)
        self.abandoned = AbandonedCalls(stage)
        observe_transfers()
        keep_node_tidy(self.runner.spec.data_plane)  # this node's shm janitor while a replica runs here
        log.info("stage %s ready in pid %d (%s)", stage, os.getpid(), self.runner.stage.runner)

    async def generate(self, call: Message) -> AsyncIterator[Message]:
        try:
            with self.abandoned.track(getattr(call, "request_id", "")):
                async for out in self.runner.handle(self.engine, call):
                    yield out
        except BaseException as exc:
            # Failed or cancelled (the ingress ends the request): drop what it left on this node's data plane
            # now, whichever node the ingress runs on (the ingress frees what it can reach too).
            request_id = getattr(call, "request_id", None)
            if request_id:
                await free_within(self.runner.io.free_request(request_id), request_id)
            # The error's traceback keeps the unwound frames of the request (its program, upstream
            # chunks) alive in a cycle that only a full garbage collection frees, which in a busy replica
            # can be minutes away, holding zero-copy payloads (connector memory) all that time. Clear
            # their locals; the traceback keeps its file/line entries for the error message.
            traceback.clear_frames(exc.__traceback__)
            raise

    async def ready(self) -> dict[str, Any]:
        from omni_kernels import cpu_capability, kernel_paths

        from omni_serve.transport.connectors import connector_stats

        import ray

        from omni_serve.transport.connectors import built_connector

        nearest = built_connector("nearest")
        return {"stage": self.stage, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(), **self.engine.stats(), "load": self.engine.load(),
                "cpu": self.cpu_use(),
                "abandoned_calls_cancelled": self.abandoned.cancelled,
                "data_plane": connector_stats(), "routes": list(nearest.recent) if nearest is not None else [],
                "kernels": {"cpu": cpu_capability().as_dict(), "paths": kernel_paths()},
                **({"parallel": self.runner.ranked.stats()} if self.runner.ranked is not None else {})}

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.engine.load()

    def cpu_use(self) -> dict[str, Any] | None:
        if not str(self.runner.engine_spec.device).startswith("cpu"):  # steps on an accelerator: not CPU seconds
            return None
        if self.runner.ranked is not None:  # its other ranks compute in processes of their own, not counted here
            return None
        use = self.engine.cpu_use()
        if use is None:
            return None
        import ray

        return {**use, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def parameter_names(self) -> list[str]:
        return [f"{prefix}.{name}" for prefix, module in self.runner.modules().items()
                for name, _ in module.named_parameters()]

    def check_health(self) -> None:
        self.runner.check_health()
        if not self.engine.alive:
            raise RuntimeError(f"engine thread of stage {self.stage} died")
        stalled, limit = self.engine.stalled_s(), self.runner.stage_spec.max_step_s
        if stalled > limit:
            raise RuntimeError(f"engine of stage {self.stage} has been in one step for {stalled:.0f} s "
                               f"(max_step_s {limit:g}): hung")

    def hang_engine_for_test(self, seconds: float) -> None:
        """Make the engine's next step block ``seconds`` (the hung-engine test); only in a replica started with
        ``OMNI_SERVE_TEST_HOOKS=1`` in its environment."""
        if os.environ.get("OMNI_SERVE_TEST_HOOKS") != "1":
            raise PermissionError("test hooks are off (OMNI_SERVE_TEST_HOOKS=1 in the stage's env_vars)")
        self.engine.hang_next_step(seconds)

    async def __del__(self):
        engine = getattr(self, "engine", None)  # None: the constructor failed before the engine existed
        if getattr(self, "abandoned", None) is not None:
            self.abandoned.close()
        try:
            if engine is not None:
                # Up to the request deadline: Serve's own graceful_shutdown_timeout_s (a deployment option it may
                # change in place, so not read here) kills the replica first when it is shorter.
                await engine.drain(self.runner.spec.ingress.request_timeout_s)
        finally:  # a failed drain must not keep the engine's threads and processes alive
            if getattr(self, "metrics", None) is not None:
                self.metrics.close()
            if engine is not None:
                await engine.cleanup()
            if getattr(self, "runner", None) is not None:
                self.runner.close()
            from omni_serve.transport.connectors import close_connectors

            try:  # what this replica put and nobody freed (its free went to another replica) goes now
                close_connectors()
            except Exception:  # noqa: BLE001 - the replica is going either way
                log.exception("closing the data-plane connectors failed")
