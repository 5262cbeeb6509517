"""What the ingress does when a stage loses its replicas, without Ray: its handles' view of the running replicas
(``omni_serve.deployments.availability``), a request waiting on a lost stage ending with a 503, and a request's
cleanup that never holds the answer for long (``omni_serve.graph.calls.free_within``). The stage calls and the
handles are in-process stand-ins; tests/multinode does it on a real cluster."""

from __future__ import annotations

import asyncio
import time

import pytest

from omni_serve.api.errors import OpenAIError
from omni_serve.deployments.availability import StageAvailability, running_replicas
from omni_serve.graph.calls import StageCalls, free_within
from omni_serve.transport.memory import MemoryConnector


class Handle:
    """A Serve handle's shape as far as ``running_replicas`` reads it."""

    def __init__(self, replicas: int | None):
        self.replicas = replicas
        router = type("R", (), {})()
        router._asyncio_router = type("A", (), {})()
        router._asyncio_router._active_request_router = type("Q", (), {})()
        router._asyncio_router._active_request_router.curr_replicas = {i: object() for i in range(replicas or 0)}
        self._router = router
        self.initialized = False

    def options(self, **kw):
        self.initialized = True
        return self

    def running_replicas_populated(self) -> bool:
        return self.replicas is not None


def test_a_stage_is_missing_only_when_its_handle_knows_it_has_no_running_replica():
    handles = {"a": Handle(2), "b": Handle(0), "c": Handle(None), "d": Handle(0)}
    availability = StageAvailability(handles, can_be_empty={"d"}, grace_s=0)
    assert all(h.initialized for s, h in handles.items() if s != "d")  # routers start learning at once
    assert availability.missing() == ["b"]


def test_a_stage_counted_empty_for_a_moment_is_not_missing():
    """A replica being replaced (migration, rolling update): the handle may count none until it hears of the new
    one; only a stage empty at every look for the grace period is missing."""
    now = [0.0]
    handle = Handle(0)
    availability = StageAvailability({"b": handle}, grace_s=3, clock=lambda: now[0])
    assert availability.missing() == [] and availability.missing(grace=False) == ["b"]  # /health sees it at once
    now[0] = 2.9
    assert availability.missing() == []
    now[0] = 3.0
    assert availability.missing() == ["b"]
    handle._router._asyncio_router._active_request_router.curr_replicas = {0: object()}  # the new one
    assert availability.missing() == []
    handle._router._asyncio_router._active_request_router.curr_replicas = {}
    now[0] = 5.0
    assert availability.missing() == []  # empty again: the grace starts over
    now[0] = 8.0
    assert availability.missing() == ["b"]
    now[0] = 20.0  # nobody looked for longer than the grace: it may have come back and gone in between
    assert availability.missing() == []
    now[0] = 22.0
    assert availability.missing() == []
    now[0] = 23.0
    assert availability.missing() == ["b"]
    assert running_replicas(object()) is None  # not a handle we know the shape of: never "missing"


class NeverAnswers:
    def __init__(self):
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(3600)

    def cancel(self):
        self.cancelled = True


def _lose_a_stage(toy_family, calls_of: dict, lose: str, timeout_s: float):
    """A request of the toy graph on stand-in calls (stage -> a call class); ``lose`` counted missing 0.3 s in:
    (the error it ended with, seconds it took, outputs it yielded, the calls)."""
    family, spec = toy_family
    opened = {}

    def open_call(stage, call):
        opened[stage] = calls_of[stage]()
        return opened[stage]

    calls = StageCalls(family.graph, spec, open_call, probe=None, connector=MemoryConnector())
    lost: list[str] = []
    calls.missing_stages = lambda: list(lost)
    from tests.toy_family.messages import EchoCall

    async def main():
        asyncio.get_running_loop().call_later(0.3, lost.append, lose)
        t0, outputs = time.monotonic(), 0
        with pytest.raises(OpenAIError) as err:
            async for _ in calls.stream("r", {s: EchoCall(request_id="r", text="x") for s in ("encode", "decode")},
                                        timeout_s=timeout_s):
                outputs += 1
        return err.value, time.monotonic() - t0, outputs

    return (*asyncio.run(main()), opened)


def test_a_request_waiting_on_a_stage_that_lost_its_last_replica_ends_with_a_503(toy_family):
    err, took, _, opened = _lose_a_stage(toy_family, {"encode": NeverAnswers, "decode": NeverAnswers}, "decode", 600)
    assert err.status_code == 503 and "Stage decode" in str(err) and err.headers["Retry-After"]
    assert took < 5 and all(c.cancelled for c in opened.values())


class KeepsAnswering(NeverAnswers):
    """A stage streaming outputs every 50 ms for as long as it is asked (a talker speaking text it already has)."""

    async def __anext__(self):
        from tests.toy_family.messages import Echoed

        await asyncio.sleep(0.05)
        return Echoed(text="x")


def test_a_lost_stage_ends_the_request_while_another_keeps_streaming(toy_family):
    """The lost stage is looked for every watch period even while outputs of another stage keep the request busy
    (the watch once ran only when no output came for a period, so a streaming stage hid a lost one). Unnoticed, the
    loss would end the request as a 504 at its deadline."""
    err, took, outputs, opened = _lose_a_stage(toy_family, {"encode": NeverAnswers, "decode": KeepsAnswering},
                                               "encode", 10)
    assert err.status_code == 503 and "Stage encode" in str(err)
    assert outputs > 5 and took < 5 and all(c.cancelled for c in opened.values())


def test_cleanup_is_waited_for_only_so_long_then_finishes_in_the_background():
    done = []

    async def slow_cleanup():
        await asyncio.sleep(0.5)
        done.append(True)

    async def main():
        t0 = time.monotonic()
        await free_within(slow_cleanup(), "r", wait_s=0.05)
        waited = time.monotonic() - t0
        assert not done
        await asyncio.sleep(0.7)
        return waited

    assert asyncio.run(main()) < 0.4 and done == [True]


@pytest.fixture
def toy_family(toy, tmp_path):
    from omni_serve.cli import main

    ckpt = str(tmp_path / "toy-tiny")
    main(["make-checkpoint", "toy", "--size", "tiny", ckpt])
    return toy, toy.validate({"checkpoint": ckpt})
