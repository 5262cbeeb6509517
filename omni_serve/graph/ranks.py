"""A stage whose replica spans several ranks: each step's rows split across them (row parallelism, batch stages),
or each layer split across them (tensor and expert parallelism, AR stages).

Contract: a stage with ``parallel.rows``, ``parallel.tensor`` or ``parallel.expert`` = R > 1
(``omni_serve.parallel.spec``) runs its engine in the replica as always, the replica computing as rank 0;
``RankedStage.start(runner)`` starts ``R - 1`` rank workers in the replica's placement group, each building the
same stage runner (parallel off) on the same spec: the same model, cache settings and computation.

Rows: ``RowSplitCompute(compute, ranks)`` replaces the runner's batched computation (``batch_compute()``): given a
step's works (each with ``program`` and ``rows``), it splits their rows across the ranks, sends each worker its
share, computes rank 0's share in the engine thread meanwhile, and puts every work's rows back together in order.
The result equals one rank's up to the float rounding of batched matrix products (a row never attends to another).

Sequence: the workers and the replica form one process group and every rank runs each step's computation on all of
its works (``SequenceSplitCompute``), its denoiser's packed forward holding a share of every row's image tokens
(``shard_sequence``); rank 0's result is the step's.

Tensor and expert: the workers and the replica form one process group (gloo on CPU, NCCL on GPU; the replica is
rank 0) and each shards its AR adapter: ``tensor`` splits heads and MLP (``PagedDecoder.shard``, one all-reduce per
block half), ``expert`` splits each MoE layer's experts (``shard_experts``, one all-reduce per MoE layer). The
replica's adapter becomes a ``ShardedModel``: each engine step's ``forward_packed`` starts the same step on every
worker (``ShardedRank``: its own paged KV cache, of its KV heads under tensor parallelism, the batch rebuilt from the
step's segments) and runs rank 0's share; the scheduler, sampling and outputs stay the replica's alone. Greedy tokens
equal one rank's (the hidden states to float rounding).

Where rows go:
- A request with cache acceleration keeps per-branch state (its cache-dit contexts) between steps, so each of its
  CFG branches stays on one rank for the whole request: the cond branch on rank 0 (the replica's session, which
  reports the request's cached-step counts), the uncond branch pinned to the worker with the fewest pinned
  requests (CFG parallelism). A worker keeps a session per request it holds a branch of; it is dropped at the
  first step after the request ends, is aborted or its program is collected (an idle replica keeps it until then).
- A request that runs its step alone (cache-dit's own forward) stays whole on rank 0.
- Every other row (no per-request state) goes to the least-loaded rank of that step.

Each step ships the rows' inputs to the workers (latents, timestep, the prompt's embeddings): a few MB per row
for the full-size models, small next to a DiT step. A tensor-parallel step ships its input embeddings and slots.

A worker that dies or does not answer within ``parallel.call_timeout_s`` fails the step's requests with
``RankLost`` (a 503 for the client), stops the other workers, and fails the replica's health check, so Serve
replaces the replica. Under tensor, expert and sequence parallelism any failure of a step, on any rank, does the
same (the ranks' collectives are out of step after it): a worker whose step fails exits, rank 0 gives the group up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import queue
import weakref
from types import SimpleNamespace
from typing import Any, Callable

from omni_serve.parallel.group import RankGroup, RankLost

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
        sequence = _parallel_of(spec, stage).sequence > 1
        self.runner = _runner_without_ranks(family, stage, spec)
        if sequence:  # in the process group already (RankWorker.setup joins it first)
            self.runner.model.shard_sequence()
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

    def compute_along(self, works: list[Any]) -> None:
        """Sequence parallelism: the replica's step on the same works, this rank's share of every row's tokens (the
        collectives pair up with the other ranks'); the results are rank 0's, nothing goes back."""
        try:
            self.compute_rows(works)
        except BaseException:
            # The ranks' collectives are out of step now: end this process so that rank 0's pending all-gather
            # fails at once (its peer is gone) instead of waiting for the group's timeout.
            log.exception("sequence-parallel rank failed its step; exiting")
            os._exit(1)

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            session = self.sessions.pop(key, None)
            if session is not None:
                session.close()
            self.forgotten[key] = None
        while len(self.forgotten) > FORGOTTEN_KEPT:
            self.forgotten.pop(next(iter(self.forgotten)))


def check_model_split(model, kind: str, world: int) -> None:
    """Raises ``ValueError`` unless ``model`` (an AR adapter) can be split ``kind`` (tensor, expert) ``world`` ways;
    changes nothing."""
    if kind == "tensor":
        model.check_shard(world)
    elif kind == "expert":
        check = getattr(model, "check_expert_shard", None)
        if check is None:
            raise ValueError(f"{type(model).__name__} has no experts to split (parallel.expert)")
        check(world)
    else:
        raise ValueError(f"no such sharded kind: {kind!r}")


def shard_model(model, kind: str, rank: int, world: int) -> None:
    """Make ``model`` this rank's share of a ``kind`` split (inside the ranks' process group)."""
    check_model_split(model, kind, world)
    if kind == "tensor":
        model.shard(rank, world)
    else:
        model.shard_experts(world)


class ShardedRank:
    """A tensor- or expert-parallel rank worker's side: the stage's AR adapter, sharded (``shard_model``), and a paged
    KV cache (of its KV heads under tensor parallelism) with the engine's geometry. ``forward`` runs the replica's
    step on the same batch (the layers' all-reduces pair up with the other ranks'); rank 0's output is the step's."""

    def __init__(self, family: str, stage: str, spec: dict[str, Any]):
        import torch.distributed as dist

        from omni_serve.engines.ar.engine import pack_model_linears
        from omni_serve.engines.ar.kv_cache import PagedKVCache
        kind = _parallel_of(spec, stage).sharded
        self.runner = _runner_without_ranks(family, stage, spec)
        self.model = self.runner.model
        shard_model(self.model, kind, dist.get_rank(), dist.get_world_size())
        c = self.runner.engine_spec.ar
        if c.packed_linear:  # as the replica's engine packs its own
            pack_model_linears(self.model, c)
        m = self.model
        self.cache = PagedKVCache(m.num_layers, m.num_kv_heads, m.head_dim, c.num_kv_blocks, c.block_size, m.dtype,
                                  m.device)

    def forward(self, step: tuple) -> None:
        """``step``: the replica's (embeds, positions, segments). No logits or hidden states are kept here."""
        import torch

        from omni_serve.engines.ar.attention import PagedBatch

        embeds, positions, segments = step
        try:
            with torch.inference_mode():
                self.model.forward_packed(embeds, positions, PagedBatch.build(self.cache, segments),
                                          torch.empty(0, dtype=torch.long), False)
        except BaseException:
            # The ranks' collectives are out of step now: end this process so that rank 0's pending all-reduce
            # fails at once (its peer is gone) instead of waiting for the group's timeout.
            log.exception("tensor-parallel rank failed its step; exiting")
            os._exit(1)


class ShardedModel:
    """The replica's AR adapter as rank 0 of a tensor- or expert-parallel group: ``forward_packed`` starts the same step on the
    workers, runs its own share, and waits for them (a lost worker: ``RankLost``); everything else is the adapter's.
    The step's batch is rebuilt on each worker's own cache from its segments (``PagedBatch.segments``)."""

    def __init__(self, adapter, ranked: "RankedStage"):
        self.adapter, self.ranked = adapter, ranked

    def __getattr__(self, name: str):
        return getattr(self.adapter, name)

    def forward_packed(self, embeds, positions, batch, logit_rows, want_hidden):
        group = self.ranked.group
        step = group.put((embeds, positions, batch.segments))  # serialized once for every worker
        refs = group.submit("forward", [(step,)] * group.world_size)
        try:
            out = self.adapter.forward_packed(embeds, positions, batch, logit_rows, want_hidden)
            group.collect(refs)
        except RankLost:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure leaves the ranks' collectives out of step
            raise group.fail(exc) from exc  # the workers stopped, the replica replaced; its requests get 503s
        return out


def _parallel_of(spec: dict[str, Any], stage: str):
    """The stage's ``parallel`` settings in a graph spec dict (what a rank worker is built from)."""
    from omni_serve.parallel.spec import ParallelSpec

    return ParallelSpec(**spec["stages"][stage].get("parallel") or {})


def _runner_without_ranks(family: str, stage: str, spec: dict[str, Any]):
    """The stage's runner with ``parallel`` off: what a rank worker computes with."""
    from omni_serve.graph.registry import load_family
    from omni_serve.graph.runner import build_runner

    spec = dict(spec)
    spec["stages"] = {**spec["stages"], stage: {**spec["stages"][stage], "parallel": {}}}
    return build_runner(load_family(family), stage, spec)


class RankedStage:
    """The replica's handle on its rank workers."""

    def __init__(self, group: RankGroup, kinds: dict[str, int] | None = None):
        self.group, self.kinds = group, kinds or {}
        self.rows = [0] * (group.world_size + 1)  # rows each rank computed (row parallelism; /health)
        self.shards = None  # the replica's SequenceShards (sequence parallelism; /health)

    @classmethod
    def start(cls, runner) -> "RankedStage":
        p, stage_spec = runner.stage_spec.parallel, runner.stage_spec
        spec = runner.spec.model_dump(mode="json")
        family = runner.family_path  # set by build_runner
        factory = "omni_serve.graph.ranks:ShardedRank" if p.sharded else "omni_serve.graph.ranks:RankStage"
        backend = None  # row parallelism needs no process group: the replica gathers the rows
        if p.grouped:  # one process group, the replica its rank 0
            backend = "nccl" if str(runner.engine_spec.device).startswith("cuda") else "gloo"
        rank_cpus, rank_gpus = p.rank_resources(stage_spec.num_cpus, stage_spec.num_gpus)
        log.info("stage %s: starting %d rank workers (%s)", runner.stage.name, p.ranks - 1, p.kinds())
        group = RankGroup(p.ranks - 1, factory, (family, runner.stage.name, spec), backend=backend,
                          num_cpus=rank_cpus, num_gpus=rank_gpus, torch_threads=runner.engine_spec.torch_threads,
                          call_timeout_s=p.call_timeout_s, first_rank=1)
        return cls(group, p.kinds())

    @property
    def ranks(self) -> int:
        return self.group.world_size + 1

    def alive(self) -> bool:
        return self.group.alive()

    def check(self) -> bool:
        """Whether every rank is alive, probing the workers (the replica's health check)."""
        return self.group.check()

    def stats(self) -> dict[str, Any]:
        out = {"ranks": self.ranks, "kinds": dict(self.kinds), "alive": self.alive(),
               "worker_pids": list(self.group.pids)}
        if "rows" in self.kinds:
            out["rows_by_rank"] = list(self.rows)
        if self.shards is not None:  # the image tokens of the steps so far, and the replica's share of them
            out["image_tokens"] = {"all": self.shards.tokens, "rank_0": self.shards.held}
        return out

    def shutdown(self) -> None:
        self.group.shutdown()


class RowSplitCompute:
    """A batched computation whose rows are split across the replica's ranks (see the module docstring)."""

    def __init__(self, compute: Callable[[list[Any]], list[Any]], ranked: RankedStage):
        self.local, self.ranked = compute, ranked
        # id(program) -> (worker, key, weakref to the program, pin token); only the engine thread touches it
        self.pins: dict[int, tuple[int, str, Any, int]] = {}
        # pin tokens of programs collected meanwhile (a finalizer may run on any thread): forgotten at the next step
        self._collected: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._tokens = itertools.count()

    def _key(self, program) -> str:
        return _program_key(program)

    def _pin(self, program) -> int:
        """The worker (1..) that holds this cached request's uncond branch, chosen once."""
        pinned = self.pins.get(id(program))
        if pinned is not None and pinned[2]() is program:
            return pinned[0]
        if pinned is not None:  # a collected program's id, reused before the sweep saw it go
            self.ranked.group.notify("forget", [pinned[1]])
        counts = [0] * self.ranked.ranks
        for worker, *_ in self.pins.values():
            counts[worker] += 1
        worker = min(range(1, self.ranked.ranks), key=lambda r: (counts[r], r))
        token = next(self._tokens)
        self.pins[id(program)] = (worker, self._key(program), weakref.ref(program), token)
        weakref.finalize(program, self._collected.put, token).atexit = False
        return worker

    def _sweep(self) -> None:
        """Forget the pinned requests that ended (done, their session closed by an abort, or collected)."""
        collected = set()
        while not self._collected.empty():
            collected.add(self._collected.get_nowait())
        ended = []
        for pid, (_, key, ref, token) in list(self.pins.items()):
            program = ref()
            session = getattr(program, "cache_session", None) if program is not None else None
            if token in collected or program is None or program.done or session is None or session.closed:
                self.pins.pop(pid, None)
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
        busy = [rank for rank in range(1, self.ranked.ranks) if shares[rank]]  # a worker without rows is not asked
        refs = self.ranked.group.submit("compute_rows", [([self._remote(w) for _, w in shares[rank]],)
                                                         for rank in busy], workers=[r - 1 for r in busy])
        results: list[list[Any]] = [[] for _ in shares]
        results[0] = self.local([w for _, w in shares[0]]) if shares[0] else []
        for rank, result in zip(busy, self.ranked.group.collect(refs) if refs else []):
            results[rank] = result
        pieces: list[list[Any]] = [[None] * len(w.rows) for w in works]
        for rank, share in enumerate(shares):
            for (i, _), result in zip(share, results[rank]):
                for r, row in zip(plan[i][rank], result):
                    pieces[i][r] = row
        return [torch.stack(p) for p in pieces]

    def _remote(self, work):
        return _remote_work(work, self._key(work.program))


def _program_key(program) -> str:
    return getattr(getattr(program, "req", None), "request_id", None) or f"program-{id(program)}"


def _remote_work(work, key: str):
    """The work as a worker gets it: its program reduced to a ``RemoteProgram``."""
    session = getattr(work, "cache_session", None)
    alone = getattr(work, "alone", False)
    cache = session.settings if session is not None and not session.closed and not alone else None
    n = getattr(work.program.req, "n", 0)
    return dataclasses.replace(work, program=RemoteProgram(key, cache, n))


class _StepProgram:
    """A work's program for one sequence-parallel step: the program, its cache session fixed for the step (held,
    or None when it was closed before the step began), so that rank 0 and the workers see the same sessions."""

    def __init__(self, program, session):
        self._program, self.cache_session = program, session

    def __getattr__(self, name: str):
        return getattr(self._program, name)


class _HeldSession:
    """A cache session held for the whole step (one ``use`` taken before the step is shipped): usable throughout,
    whatever an abort does meanwhile (its ``close`` waits for the hold to end)."""

    def __init__(self, session):
        self._session = session

    def __getattr__(self, name: str):
        return getattr(self._session, name)

    @contextlib.contextmanager
    def use(self):
        yield True


class SequenceSplitCompute:
    """A batched computation every rank runs on the same works, each holding a share of every row's image tokens
    (sequence parallelism: ``shard_sequence``); rank 0's results are the step's. Every rank must issue the same
    collectives, so what a step computes is fixed on rank 0 before it is shipped: each cached request's session is
    held for the step (or, closed by an abort before it began, left out on every rank), and each request has a key
    of its own (request id and a counter: a reused id never meets another's cache state). A cached request has a
    cache session on every rank, each deciding on the gathered residual (the same decision); a worker drops its
    session at the first step after the request ends, is aborted or its program is collected. Any failure of a step
    gives the group up (the ranks' collectives are out of step after it): its requests fail with ``RankLost`` (a
    503) and the replica is replaced."""

    def __init__(self, compute: Callable[[list[Any]], list[Any]], ranked: RankedStage):
        self.local, self.ranked = compute, ranked
        self.cached: dict[str, Any] = {}  # key -> weakref to the program of a request with a cache session
        self._keys: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()
        self._counter = itertools.count()

    def _key(self, program) -> str:
        key = self._keys.get(program)
        if key is None:
            key = self._keys[program] = f"{_program_key(program)}#{next(self._counter)}"
        return key

    def _sweep(self) -> None:
        ended = []
        for key, ref in list(self.cached.items()):
            program = ref()
            session = getattr(program, "cache_session", None) if program is not None else None
            if program is None or program.done or session is None or session.closed:
                del self.cached[key]
                ended.append(key)
        if ended:
            self.ranked.group.notify("forget", ended)

    def _for_step(self, work, held: contextlib.ExitStack):
        """The work with its session held for the step (or none), and what a worker gets of it."""
        session, key = work.cache_session, self._key(work.program)
        if session is not None:
            if held.enter_context(session.use()):
                self.cached.setdefault(key, weakref.ref(work.program))
                session = _HeldSession(session)
            else:  # closed by an abort: computed plainly on every rank (its result is dropped)
                session = None
        work = dataclasses.replace(work, program=_StepProgram(work.program, session))
        return work, _remote_work(work, key)

    def __call__(self, works: list[Any]) -> list[Any]:
        self._sweep()
        group = self.ranked.group
        with contextlib.ExitStack() as held:
            local, shipped = zip(*(self._for_step(w, held) for w in works))
            step = group.put(list(shipped))  # serialized once for every worker
            refs = group.submit("compute_along", [(step,)] * group.world_size)
            try:
                out = self.local(list(local))
                group.collect(refs)
            except RankLost:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure leaves the ranks' collectives out of step
                raise group.fail(exc) from exc
        return out
