"""A batch stage whose replica spans several ranks: each step's rows split across them (row parallelism).

Contract: a stage with ``parallel.rows = R > 1`` (``omni_serve.parallel.spec``) runs its engine in the replica as
always, the replica computing as rank 0; ``RankedStage.start(runner)`` starts ``R - 1`` rank workers in the
replica's placement group, each building the same stage runner (parallel off) on the same spec: the same model,
cache settings and batched computation. ``RowSplitCompute(compute, ranks)`` replaces the runner's batched
computation (``batch_compute()``): given a step's works (each with ``program`` and ``rows``), it splits their rows
across the ranks, sends each worker its share, computes rank 0's share in the engine thread meanwhile, and puts
every work's rows back together in order. The result equals one rank's up to the float rounding of batched matrix
products (a row never attends to another).

Where rows go:
- A request with cache acceleration keeps per-branch state (its cache-dit contexts) between steps, so each of its
  CFG branches stays on one rank for the whole request: the cond branch on rank 0 (the replica's session, which
  reports the request's cached-step counts), the uncond branch pinned to the worker with the fewest pinned
  requests (CFG parallelism). A worker keeps a session per request it holds a branch of; it is dropped when the
  request ends or is aborted (swept at the next step, and when the replica lets go of the program).
- A request that runs its step alone (cache-dit's own forward) stays whole on rank 0.
- Every other row (no per-request state) goes to the least-loaded rank of that step.

Each step ships the rows' inputs to the workers (latents, timestep, the prompt's embeddings): a few MB per row
for the full-size models, small next to a DiT step.

A worker that dies or does not answer within ``parallel.call_timeout_s`` fails the step's requests with
``RankLost`` (a 503 for the client), stops the other workers, and fails the replica's health check, so Serve
replaces the replica.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from types import SimpleNamespace
from typing import Any, Callable

from omni_serve.parallel.group import RankGroup, RankLost  # noqa: F401 - RankLost is part of this contract

log = logging.getLogger(__name__)

FORGOTTEN_KEPT = 4096  # request keys a worker remembers as ended (a late step of one computes uncached)


@dataclasses.dataclass(frozen=True)
class RemoteProgram:
    """What a worker learns of a work's program: its key, and its cache settings when its branch is cached."""

    key: str
    cache: Any = None  # CacheSettings of a cached request's branch held by the worker
    num_images: int = 0


class RankStage:
    """A rank worker's side: the stage runner (parallel off) and the cache sessions of the branches it holds."""

    def __init__(self, family: str, stage: str, spec: dict[str, Any]):
        from omni_serve.graph.registry import load_family
        from omni_serve.graph.runner import build_runner

        spec = dict(spec)
        spec["stages"] = {**spec["stages"], stage: {**spec["stages"][stage], "parallel": {}}}
        self.runner = build_runner(load_family(family), stage, spec)
        self.compute = self.runner.batch_compute()
        self.sessions: dict[str, Any] = {}
        self.forgotten: dict[str, None] = {}

    def _program(self, remote: RemoteProgram):
        session = None
        if remote.cache is not None and remote.key not in self.forgotten:
            session = self.sessions.get(remote.key)
            if session is None:
                session = self.sessions[remote.key] = self.runner.cache_session(remote.cache, remote.num_images)
        return SimpleNamespace(cache_session=session)

    def compute_rows(self, works: list[Any]) -> list[Any]:
        import torch

        with torch.inference_mode():  # as the replica's engine thread computes
            return self.compute([dataclasses.replace(w, program=self._program(w.program)) for w in works])

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            session = self.sessions.pop(key, None)
            if session is not None:
                session.close()
            self.forgotten[key] = None
        while len(self.forgotten) > FORGOTTEN_KEPT:
            self.forgotten.pop(next(iter(self.forgotten)))

    def held(self) -> list[str]:
        """Keys of the requests whose cache sessions this worker holds (tests: nothing left behind)."""
        return sorted(self.sessions)


class RankedStage:
    """The replica's handle on its rank workers."""

    def __init__(self, group: RankGroup):
        self.group = group
        self.rows = [0] * (group.world_size + 1)  # rows each rank computed (the replica's /health: ranks)

    @classmethod
    def start(cls, runner) -> "RankedStage":
        p, stage_spec = runner.stage_spec.parallel, runner.stage_spec
        spec = runner.spec.model_dump(mode="json")
        family = runner.family_path  # set by build_runner
        backend = None  # row parallelism needs no process group: the replica gathers the rows
        rank_cpus = stage_spec.num_cpus if p.rank_cpus is None else p.rank_cpus
        rank_gpus = stage_spec.num_gpus if p.rank_gpus is None else p.rank_gpus
        log.info("stage %s: starting %d rank workers (rows %d)", runner.stage.name, p.ranks - 1, p.rows)
        group = RankGroup(p.ranks - 1, "omni_serve.graph.ranks:RankStage", (family, runner.stage.name, spec),
                          backend=backend, num_cpus=rank_cpus, num_gpus=rank_gpus,
                          torch_threads=runner.engine_spec.torch_threads, call_timeout_s=p.call_timeout_s,
                          first_rank=1)
        return cls(group)

    @property
    def ranks(self) -> int:
        return self.group.world_size + 1

    def alive(self) -> bool:
        return self.group.alive()

    def stats(self) -> dict[str, Any]:
        return {"ranks": self.ranks, "alive": self.alive(), "rows_by_rank": list(self.rows),
                "worker_pids": list(self.group.pids)}

    def shutdown(self) -> None:
        self.group.shutdown()


class RowSplitCompute:
    """A batched computation whose rows are split across the replica's ranks (see the module docstring)."""

    def __init__(self, compute: Callable[[list[Any]], list[Any]], ranked: RankedStage):
        self.local, self.ranked = compute, ranked
        self.pins: dict[int, tuple[int, str, Any]] = {}  # id(program) -> (worker, key, weakref to the program)
        self._counter = 0

    def _key(self, program) -> str:
        return getattr(getattr(program, "req", None), "request_id", None) or f"program-{id(program)}"

    def _pin(self, program) -> int:
        """The worker (1..) that holds this cached request's uncond branch, chosen once."""
        pinned = self.pins.get(id(program))
        if pinned is not None and pinned[2]() is program:
            return pinned[0]
        counts = [0] * self.ranked.ranks
        for worker, _, _ in self.pins.values():
            counts[worker] += 1
        worker = min(range(1, self.ranked.ranks), key=lambda r: (counts[r], r))
        key = self._key(program)
        self.pins[id(program)] = (worker, key, weakref.ref(program))
        weakref.finalize(program, self._release, id(program), key)
        return worker

    def _release(self, pid: int, key: str) -> None:
        if self.pins.pop(pid, None) is not None:
            self.ranked.group.notify("forget", [key])

    def _sweep(self) -> None:
        """Forget the pinned requests that ended (done, or their session closed by an abort)."""
        ended = []
        for pid, (_, key, ref) in list(self.pins.items()):
            program = ref()
            session = getattr(program, "cache_session", None) if program is not None else None
            if program is None or program.done or session is None or session.closed:
                del self.pins[pid]
                ended.append(key)
        if ended:
            self.ranked.group.notify("forget", ended)

    def assign(self, works: list[Any]) -> list[list[list[int]]]:
        """Per work, per rank, the work's rows that rank computes."""
        ranks = self.ranked.ranks
        loads = [0] * ranks
        plan = [[[] for _ in range(ranks)] for _ in works]
        free: list[tuple[int, int]] = []  # (work, row) without per-request state
        for i, w in enumerate(works):
            session = getattr(w, "cache_session", None)
            if getattr(w, "alone", False):
                plan[i][0] = list(range(len(w.rows)))
                loads[0] += len(w.rows)
            elif session is not None and not session.closed:
                for branch, rows in session.branches(len(w.rows)):
                    rank = 0 if branch == "cond" else self._pin(w.program)
                    plan[i][rank] += list(range(rows.start, rows.stop))
                    loads[rank] += rows.stop - rows.start
            else:
                free += [(i, r) for r in range(len(w.rows))]
        for i, r in free:
            rank = min(range(ranks), key=lambda k: (loads[k], k))
            plan[i][rank].append(r)
            loads[rank] += 1
        return plan

    def __call__(self, works: list[Any]) -> list[Any]:
        import torch

        self._sweep()
        plan = self.assign(works)
        for rank in range(self.ranked.ranks):
            self.ranked.rows[rank] += sum(len(p[rank]) for p in plan)
        shares: list[list[tuple[int, Any]]] = [[] for _ in range(self.ranked.ranks)]
        for i, w in enumerate(works):
            for rank, rows in enumerate(plan[i]):
                if rows:
                    shares[rank].append((i, dataclasses.replace(w, rows=[w.rows[r] for r in rows])))
        remote = [[self._remote(w) for _, w in share] for share in shares[1:]]
        refs = self.ranked.group.submit("compute_rows", [(r,) for r in remote]) if any(remote) else []
        results: list[list[Any]] = [self.local([w for _, w in shares[0]]) if shares[0] else []]
        results += self.ranked.group.collect(refs) if refs else [[] for _ in remote]
        pieces: list[list[Any]] = [[None] * len(w.rows) for w in works]
        for rank, share in enumerate(shares):
            for (i, _), result in zip(share, results[rank]):
                for r, row in zip(plan[i][rank], result):
                    pieces[i][r] = row
        return [torch.stack(p) for p in pieces]

    def _remote(self, work):
        session = getattr(work, "cache_session", None)
        key = self._key(work.program)
        alone = getattr(work, "alone", False)
        cache = session.settings if session is not None and not session.closed and not alone else None
        n = getattr(work.program.req, "n", 0)
        return dataclasses.replace(work, program=RemoteProgram(key, cache, n))
