"""Drain this Ray node before it goes away: what the chart's preStop hook runs before ``ray stop``.

Contract: ``drain_node(deadline_s, poll_s, out, address)`` connects to the running cluster (``address``, by default
``RAY_ADDRESS`` or the local node's cluster), asks the GCS to drain the node it runs on (reason preemption, deadline
``deadline_s`` from now), then waits (``wait_until_gone``) until no Serve replica and no Serve proxy runs on the
node any more, printing progress to ``out``; it returns 0 then, 1 when something was still there at the deadline
(the caller stops the node anyway), 2 when the GCS refused the drain. The head node is not drained (Serve's
controller and the data directory live there; a head pod leaves only with its cluster): it returns 0 at once and
says so.

What the drain does (Ray Serve, ``migrate_replicas_on_draining_nodes``): Serve starts a replacement for every
replica on the draining node elsewhere, then stops the old one the graceful way: no new calls, the calls in flight
run to their end (up to the deployment's ``graceful_shutdown_timeout_s``; a stage's defaults to the request
deadline), then the stage drains its engine. Once no replica is left, the node's proxy drains too: it takes no new
connections and ends when the streams it relays have ended. Serve stops a migrating replica at the drain's deadline
minus its ``graceful_shutdown_timeout_s`` whether or not its replacement runs, so ``deadline_s`` must exceed the
longest graceful timeout by the time a replacement takes to start: 600 s by default (the 300 s request deadline,
then 300 s to start). The chart sets the pod's grace period from the same value.

Not waited for: a data directory or Mooncake master actor that Ray restarted onto this worker after the head was
lost (they live on the head otherwise); ``ray stop`` ends them and Ray restarts them elsewhere, empty.

Why not ``ray drain-node`` alone: it only asks; nothing waits for the replicas to leave, and ``ray stop`` right
after it would kill them mid-request.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable, TextIO

REPLICA_CLASS_PREFIX = "ServeReplica:"  # Ray Serve's replica actors' class names
PROXY_NAME_PREFIX = "SERVE_PROXY_ACTOR"  # Ray Serve's proxy actors' names (ray.serve._private.constants)
DEFAULT_DEADLINE_S = 600.0


def serve_actors_on(node_id: str) -> list[str]:
    """The live Serve replicas (by deployment) and proxy on ``node_id``, from the GCS (no dashboard needed)."""
    from ray._private import state

    out = []
    for actor in state.actors(actor_state_name="ALIVE").values():
        if actor["Address"]["NodeID"] != node_id:
            continue
        if actor["ActorClassName"].startswith(REPLICA_CLASS_PREFIX):
            out.append(actor["ActorClassName"][len(REPLICA_CLASS_PREFIX):])
        elif (actor.get("Name") or "").startswith(PROXY_NAME_PREFIX):
            out.append("proxy")
    return sorted(out)


def wait_until_gone(left: Callable[[], list[str]], deadline_s: float, poll_s: float, out: TextIO,
                    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll ``left()`` until it is empty (0) or ``deadline_s`` passed (1), printing what is still there."""
    start = clock()
    while True:
        still, waited = left(), clock() - start
        if not still:
            print(f"nothing of Serve left on this node after {waited:.0f} s: drained", file=out, flush=True)
            return 0
        if waited >= deadline_s:
            print(f"deadline: still on this node after {waited:.0f} s: {', '.join(still)}", file=out, flush=True)
            return 1
        print(f"{waited:.0f} s: still on this node: {', '.join(still)}", file=out, flush=True)
        sleep(poll_s)


def _is_head(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and "node:__internal_head__" in n.get("Resources", {})
               for n in ray.nodes())


def drain_node(deadline_s: float = DEFAULT_DEADLINE_S, poll_s: float = 2.0, out: TextIO = sys.stdout,
               address: str | None = None) -> int:
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
        print(f"draining node {node_id[:12]} (up to {deadline_s:g} s): Serve moves its replicas elsewhere",
              file=out, flush=True)
        return wait_until_gone(lambda: serve_actors_on(node_id), deadline_s, poll_s, out)
    finally:
        ray.shutdown()
