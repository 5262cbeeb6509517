"""Drain this Ray node before it goes away: what the chart's preStop hook runs before ``ray stop``.

Contract: ``drain_node(deadline_s, poll_s, out, address)`` connects to the running cluster (``address``, by default
``RAY_ADDRESS`` or the local node's cluster), asks the
GCS to drain the node it runs on (reason preemption, deadline ``deadline_s`` from now), then waits until no Serve
replica runs on the node any more, printing progress to ``out``; it returns 0 then, 1 when replicas were still
there at the deadline (the caller stops the node anyway), 2 when the GCS refused the drain. The head node is not
drained (Serve's controller and the data directory live there; a head pod leaves only with its cluster): it
returns 0 at once and says so.

What the drain does (Ray Serve, ``migrate_replicas_on_draining_nodes``): Serve starts a replacement for every
replica on the draining node elsewhere, then stops the old one the graceful way: no new calls, the calls in
flight run to their end (up to the deployment's ``graceful_shutdown_timeout_s``; a stage's defaults to the
request deadline), then the stage drains its engine. So a pod's termination loses no request as long as the
pod's grace period covers the drain (the chart sets ``terminationGracePeriodSeconds`` from the same value) and
the cluster has room for the replacements.

Why not ``ray drain-node`` alone: it only asks; nothing waits for the replicas to leave, and ``ray stop`` right
after it would kill them mid-request.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

REPLICA_CLASS_PREFIX = "ServeReplica:"  # Ray Serve's replica actors' class names


def _replicas_on(node_id: str) -> list[str]:
    """Names of the live Serve replica actors on ``node_id`` (from the GCS: no dashboard needed)."""
    from ray._private import state

    alive = state.actors(actor_state_name="ALIVE").values()
    return sorted(a["ActorClassName"][len(REPLICA_CLASS_PREFIX):] for a in alive
                  if a["ActorClassName"].startswith(REPLICA_CLASS_PREFIX)
                  and a["Address"]["NodeID"] == node_id)


def _is_head(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and "node:__internal_head__" in n.get("Resources", {})
               for n in ray.nodes())


def drain_node(deadline_s: float, poll_s: float = 2.0, out: TextIO = sys.stdout, address: str | None = None) -> int:
    import ray
    from ray.core.generated import autoscaler_pb2

    ray.init(address=address or os.environ.get("RAY_ADDRESS") or "auto", logging_level="ERROR", log_to_driver=False)
    try:
        node_id = ray.get_runtime_context().get_node_id()
        if _is_head(node_id):
            print(f"node {node_id[:12]} is the head: not drained (Serve's controller and the data directory "
                  "live here)", file=out, flush=True)
            return 0
        accepted, why = ray._private.worker.global_worker.gcs_client.drain_node(
            node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "omni-serve drain-node: the pod is terminating", int((time.time() + deadline_s) * 1000))
        if not accepted:
            print(f"the GCS refused to drain node {node_id[:12]}: {why}", file=out, flush=True)
            return 2
        start = time.monotonic()
        print(f"draining node {node_id[:12]} (up to {deadline_s:g} s): Serve moves its replicas elsewhere",
              file=out, flush=True)
        while True:
            left = _replicas_on(node_id)
            waited = time.monotonic() - start
            if not left:
                print(f"node {node_id[:12]} holds no Serve replica after {waited:.0f} s: drained",
                      file=out, flush=True)
                return 0
            if waited >= deadline_s:
                print(f"deadline: {len(left)} replicas still on node {node_id[:12]} after {waited:.0f} s: "
                      f"{', '.join(left)}", file=out, flush=True)
                return 1
            print(f"{waited:.0f} s: {len(left)} replicas still on this node ({', '.join(left)})",
                  file=out, flush=True)
            time.sleep(poll_s)
    finally:
        ray.shutdown()
