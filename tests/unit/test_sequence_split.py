"""What a sequence-parallel step ships to its workers (``omni_serve.graph.ranks.SequenceSplitCompute``), without Ray:
every rank must issue the same collectives, so the replica fixes a step's cache state before shipping it. A cached
request's session is held for the whole step (an abort that closes it mid-step waits, and the replica's own forward
still uses it, as the workers do), a session closed before the step is left out on every rank, two requests with
one id get keys of their own, and the workers forget a request once it ends. The ranks are a fake group; the served
two-rank graphs are in tests/integration/test_parallel_stages.py."""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

from omni_serve.graph.ranks import RankedStage, SequenceSplitCompute


class Session:
    """A cache session's ``use``/``close`` semantics (``CacheSession``): a close during a use waits for it."""

    def __init__(self):
        self.closed, self.pending, self.users, self.settings = False, False, 0, "settings"

    @contextlib.contextmanager
    def use(self):
        usable = not (self.closed or self.pending)
        self.users += usable
        try:
            yield usable
        finally:
            if usable:
                self.users -= 1
                if not self.users and self.pending:
                    self.closed = True

    def close(self):
        if self.users:
            self.pending = True
        else:
            self.closed = True


@dataclasses.dataclass
class Work:
    program: object
    rows: list

    @property
    def cache_session(self):
        return self.program.cache_session


class Program:
    def __init__(self, rid: str, cached: bool = True):
        self.req, self.done = SimpleNamespace(request_id=rid, n=1), False
        self.cache_session = Session() if cached else None


class FakeGroup:
    world_size = 1

    def __init__(self):
        self.shipped, self.forgotten = [], []

    def put(self, value):
        return value

    def submit(self, method, per_rank_args, workers=None):
        assert method == "compute_along"
        self.shipped.append(per_rank_args[0][0])
        return []

    def collect(self, refs):
        return refs

    def notify(self, method, keys):
        self.forgotten += keys


def _split(local):
    group = FakeGroup()
    return SequenceSplitCompute(local, RankedStage(group, {"sequence": 2})), group


def _used(works):
    """What the replica's computation saw: per work, whether its session was usable (None: no session)."""
    out = []
    for w in works:
        if w.cache_session is None:
            out.append(None)
        else:
            with w.cache_session.use() as usable:
                out.append(usable)
    return out


def test_an_abort_mid_step_leaves_the_replica_computing_what_it_shipped():
    a, b = Program("a"), Program("b")
    seen = []

    def local(works):
        a.cache_session.close()  # an abort lands after the step was shipped, before this rank's forward
        seen.append(_used(works))
        return [w.rows for w in works]

    split, group = _split(local)
    out = split([Work(a, [1]), Work(b, [2])])
    assert out == [[1], [2]]
    assert seen == [[True, True]]  # still held: the replica computes it cached, as the workers were told
    assert [w.program.cache for w in group.shipped[0]] == ["settings", "settings"]
    assert a.cache_session.closed  # the close went through once the step let go


def test_a_session_closed_before_the_step_is_left_out_on_every_rank():
    a, b = Program("a"), Program("b", cached=False)
    a.cache_session.close()
    seen = []
    split, group = _split(lambda works: seen.append(_used(works)) or [None] * len(works))
    split([Work(a, [1]), Work(b, [2])])
    assert seen == [[None, None]]
    assert [w.program.cache for w in group.shipped[0]] == [None, None]


def test_two_requests_with_one_id_have_keys_of_their_own_and_are_forgotten_when_they_end():
    a1, a2 = Program("a"), Program("a")
    split, group = _split(lambda works: [None] * len(works))
    split([Work(a1, [1]), Work(a2, [2])])
    keys = [w.program.key for w in group.shipped[0]]
    assert len(set(keys)) == 2 and all(k.startswith("a#") for k in keys)
    split([Work(a1, [1]), Work(a2, [2])])
    assert [w.program.key for w in group.shipped[1]] == keys  # the same key for a request's every step
    a1.done = True
    split([Work(a2, [2])])
    assert group.forgotten == [keys[0]]
