"""How a step's rows are split across a replica's ranks (``omni_serve.graph.ranks.RowSplitCompute``), without
Ray: every row computed by exactly one rank and put back in its place, a cached request's cond branch on rank 0
and its uncond branch on the same worker for the whole request, a request that runs alone kept whole on rank 0,
the rest balanced, and the workers told to forget a request once it ends. The ranks here are a fake group that
computes in-process (the served two-rank graphs are in tests/integration/test_parallel_stages.py)."""

from __future__ import annotations

import dataclasses
import gc
from types import SimpleNamespace

import torch

from omni_serve.graph.ranks import RankedStage, RowSplitCompute


@dataclasses.dataclass
class Work:
    program: object
    rows: list
    alone: bool = False

    @property
    def cache_session(self):
        return getattr(self.program, "cache_session", None)


class Session:
    def __init__(self, n: int):
        self.n, self.closed, self.settings = n, False, "settings"

    def branches(self, num_rows: int):
        names = ("cond", "uncond")[:num_rows // self.n]
        return [(b, slice(i * self.n, (i + 1) * self.n)) for i, b in enumerate(names)]


class FakeGroup:
    def __init__(self, workers: int):
        self.world_size, self.pids, self.calls, self.forgotten = workers, [], [], []

    def alive(self):
        return True

    def submit(self, method, per_rank_args, workers=None):
        assert all(args[0] for args in per_rank_args), "a worker without rows was asked to compute"
        self.calls.append([args[0] for args in per_rank_args])
        return [_rows_of(args[0]) for args in per_rank_args]

    def collect(self, refs):
        return refs

    def notify(self, method, keys):
        self.forgotten += keys

    def check(self):
        return True


def _rows_of(works):
    return [torch.tensor(w.rows, dtype=torch.float32) * 10 for w in works]


class Program:  # a program as the split sees it (weak references allowed, as to a real one)
    def __init__(self, rid: str, n: int, cached: bool):
        self.req, self.done = SimpleNamespace(request_id=rid, n=n), False
        self.cache_session = Session(n) if cached else None


_program = Program


def _split(workers: int = 1):
    group = FakeGroup(workers)
    return RowSplitCompute(_rows_of, RankedStage(group, {"rows": workers + 1})), group


def test_every_row_comes_back_in_place_and_the_ranks_share_them():
    split, group = _split(2)
    works = [Work(_program(f"r{i}", 1, False), [i * 10 + j for j in range(k)]) for i, k in enumerate((3, 1, 4))]
    out = split(works)
    assert [o.tolist() for o in out] == [[r * 10.0 for r in w.rows] for w in works]
    assert split.ranked.rows == [3, 3, 2]  # 8 rows over 3 ranks, balanced


def test_a_cached_requests_branches_stay_on_their_ranks_and_are_forgotten_when_it_ends():
    split, group = _split(2)
    a, b = _program("a", 2, True), _program("b", 1, True)
    works = [Work(a, [0, 1, 2, 3]), Work(b, [4, 5])]  # both with CFG: cond rows then uncond rows
    for _ in range(3):
        plan = split.assign(works)
        assert plan[0][0] == [0, 1] and plan[1][0] == [0]  # cond on the replica (its session counts the steps)
        assert plan[0][1] == [2, 3] and plan[1][2] == [1]  # uncond pinned to a worker each, for good
        split(works)
    a.done = True
    split([Work(b, [4, 5])])
    assert group.forgotten == ["a"]
    b.cache_session.closed = True  # aborted
    split([Work(_program("c", 1, False), [7])])
    assert group.forgotten == ["a", "b"] and split.pins == {}


def test_workers_without_rows_are_not_asked():
    split, group = _split(3)
    cached = Program("a", 1, True)
    out = split([Work(cached, [5, 6])])  # cond on the replica, uncond on one worker, two workers idle
    assert [o.tolist() for o in out] == [[50.0, 60.0]] and len(group.calls[-1]) == 1


def test_a_request_that_runs_alone_stays_whole_on_rank_zero():
    split, _ = _split(1)
    plan = split.assign([Work(_program("a", 1, True), [0, 1], alone=True), Work(_program("b", 1, False), [2, 3])])
    assert plan[0] == [[0, 1], []] and plan[1] == [[], [0, 1]]


def test_a_collected_program_is_forgotten_at_the_next_step():
    split, group = _split(1)
    program = Program("gone", 1, True)
    split([Work(program, [0, 1])])
    del program
    gc.collect()
    split([Work(Program("x", 1, False), [2])])
    assert group.forgotten == ["gone"] and split.pins == {}
