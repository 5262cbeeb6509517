"""A replica's group of rank workers: one Ray actor per rank, one ``torch.distributed`` group among them.

Contract: ``RankGroup(world_size, factory, args, backend, num_cpus, torch_threads)``, made inside a stage replica,
starts ``world_size`` ``RankWorker`` actors. In a placement group (a Serve deployment with
``placement_group_bundles = rank_bundles(...)``: the replica's own bundle first, then one per rank, STRICT_PACK),
rank ``i`` goes to bundle ``i + 1``; elsewhere (tests) Ray places them. Rank 0 picks a free port on its node, every
rank joins ``torch.distributed`` there (``backend``: ``gloo`` on CPU, ``nccl`` on GPU), then builds its model,
``factory(*args)`` (``factory``: ``"module:callable"``). ``await group.call(method, *args)`` runs
``model.method(*args)`` on every rank at once (collectives inside it pair up) and returns the results by rank;
``submit``/``collect`` do the same with each rank's own arguments, for a caller (an engine thread) that computes a
share itself meanwhile: with ``first_rank=1`` the caller is rank 0 and the workers take bundles 1..; with a
``backend`` too, the caller joins the process group as rank 0 (tensor parallelism: its engine thread's collectives
pair up with the workers').
A rank that died makes ``call`` raise ``RankLost`` and ``alive()`` False (the replica's health check fails, Serve
replaces the replica and its requests end with a 503), never a hang: a call that does not come back within
``call_timeout_s`` kills the group. ``shutdown()`` kills the workers and leaves the process group; calling it again
does nothing.

Why Ray actors, not ``torch.multiprocessing``: each rank may need a device of its own and a place in the replica's
placement group (the Ray Serve LLM / vLLM pattern), and Ray reports a dead rank as an error on the call.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
from typing import Any

import ray


class RankLost(RuntimeError):
    """A rank worker of the group died or stopped answering."""


def rank_bundles(replica: dict[str, float], rank_cpus: float, world_size: int,
                 rank_gpus: float = 0.0) -> list[dict]:
    """A deployment's ``placement_group_bundles``: the replica's own bundle (its resources), then one per rank."""
    rank = {"CPU": rank_cpus, **({"GPU": rank_gpus} if rank_gpus else {})}
    return [dict(replica)] + [dict(rank) for _ in range(world_size)]


def free_address() -> str:
    """A ``tcp://IP:PORT`` init method on this node (a port free now)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{ray.util.get_node_ip_address()}:{port}"


def join_group(backend: str, init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the ``torch.distributed`` group; a collective waiting longer than ``timeout_s`` for a rank fails."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _load(factory: str):
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


class RankWorker:
    """One rank: joins the group (when there is a backend), builds the model, runs its methods."""

    def __init__(self, rank: int, world_size: int, torch_threads: int):
        import torch

        torch.set_num_threads(torch_threads)
        self.rank, self.world_size, self.model = rank, world_size, None

    def address(self) -> str:
        return free_address()

    def setup(self, init_method: str | None, backend: str | None, factory: str, args: tuple,
              timeout_s: float = 600.0) -> None:
        if backend is not None:
            join_group(backend, init_method, self.rank, self.world_size, timeout_s)
        self.model = _load(factory)(*args)

    def call(self, method: str, *args) -> Any:
        return getattr(self.model, method)(*args)

    def pid(self) -> int:
        return os.getpid()


class RankGroup:
    """``world_size`` rank workers; with ``first_rank`` 1 they are ranks 1.. of a group whose rank 0 is the caller
    (which then takes bundle 0's place and joins no process group here: ``backend`` None)."""

    def __init__(self, world_size: int, factory: str, args: tuple = (), backend: str | None = "gloo",
                 num_cpus: float = 1.0, num_gpus: float = 0.0, torch_threads: int = 1, call_timeout_s: float = 600.0,
                 first_rank: int = 0):
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.world_size, self.call_timeout_s, self.first_rank = world_size, call_timeout_s, first_rank
        self._dead: str | None = None
        pg = get_current_placement_group()
        worker = ray.remote(RankWorker)
        self.workers = []
        for i in range(world_size):
            options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": 0}
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i + 1)
            rank = first_rank + i
            self.workers.append(worker.options(**options).remote(rank, first_rank + world_size, torch_threads))
        self.joined = False  # whether this process is rank 0 of the group's process group
        self._probe: tuple[list, float] | None = None  # check()'s last probe: its references, when it was sent
        try:
            caller_joins = backend is not None and first_rank == 1
            init_method = None
            if backend is not None:
                init_method = free_address() if caller_joins else ray.get(self.workers[0].address.remote())
            setups = [w.setup.remote(init_method, backend, factory, tuple(args), call_timeout_s)
                      for w in self.workers]
            if caller_joins:  # rank 0 is this process: join while the workers do
                join_group(backend, init_method, 0, first_rank + world_size, call_timeout_s)
                self.joined = True
            ray.get(setups, timeout=call_timeout_s)
            self.pids = ray.get([w.pid.remote() for w in self.workers], timeout=call_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def alive(self) -> bool:
        return self._dead is None

    def check(self) -> bool:
        """``alive()``, also noticing a worker that died between calls: each check looks at the answer to the
        previous check's probe (a worker answers once its current call is done) and sends a new one. A probe
        unanswered for longer than ``call_timeout_s`` counts as a lost rank, as a call would."""
        if self._dead is not None or not self.workers:
            return self.alive()
        import time

        if self._probe is not None:
            refs, sent = self._probe
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs):
                if time.monotonic() - sent > self.call_timeout_s:
                    self._lost(TimeoutError("a rank did not answer its health probe"))
                return self.alive()
            try:
                ray.get(refs)
            except ray.exceptions.RayError as exc:
                self._lost(exc)
                return False
        self._probe = ([w.pid.remote() for w in self.workers], time.monotonic())
        return True

    def _lost(self, exc: BaseException) -> RankLost:
        if self._dead is None:
            self._dead = f"a rank of the group was lost: {type(exc).__name__}"
        self._kill_workers()  # the survivors would wait for it in their next collective
        return RankLost(self._dead)

    def fail(self, exc: BaseException) -> RankLost:
        """Give the group up after a failed collective step (the ranks' collectives are out of step): the workers
        are stopped and ``RankLost`` (for the caller to raise) says why."""
        return self._lost(exc)

    async def call(self, method: str, *args) -> list[Any]:
        """``model.method(*args)`` on every rank at once; the results by rank."""
        refs = self.submit(method, [args] * len(self.workers))
        return await asyncio.to_thread(self.collect, refs)

    def submit(self, method: str, per_rank_args: list[tuple],
               workers: list[int] | None = None) -> list["ray.ObjectRef"]:
        """Start ``model.method(*per_rank_args[i])`` on worker ``workers[i]`` (default: worker ``i``; each its own
        arguments); ``collect`` the references. For a caller that computes its own share meanwhile (a thread, not
        an event loop)."""
        if self._dead is not None:
            raise RankLost(self._dead)
        chosen = [self.workers[i] for i in workers] if workers is not None else self.workers
        return [w.call.remote(method, *args) for w, args in zip(chosen, per_rank_args)]

    def put(self, value: Any) -> "ray.ObjectRef":
        """``value`` serialized once, for the arguments of a ``submit`` to every worker."""
        return ray.put(value)

    def collect(self, refs: list["ray.ObjectRef"]) -> list[Any]:
        """The results of ``submit``, waiting at most ``call_timeout_s``; a lost rank raises ``RankLost``."""
        try:
            return ray.get(refs, timeout=self.call_timeout_s)
        except ray.exceptions.RayTaskError:
            raise  # the method itself failed on a rank: the step's requests fail, the ranks live on
        except ray.exceptions.RayError as exc:  # a dead rank, node or owner, a lost result, a timeout
            raise self._lost(exc) from None

    def notify(self, method: str, *args) -> None:
        """``model.method(*args)`` on every rank, not waited for (a lost rank shows in the next call)."""
        if self._dead is None:
            for w in self.workers:
                w.call.remote(method, *args)

    def _kill_workers(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            ray.kill(w, no_restart=True)
        if workers and self._dead is None:
            self._dead = "the group was shut down"

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (once the caller's collectives are over: its engine has
        stopped); calling it again does nothing."""
        self._kill_workers()
        if getattr(self, "joined", False):
            import torch.distributed as dist

            self.joined = False
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a group whose peers are gone may not tear down cleanly
                pass
