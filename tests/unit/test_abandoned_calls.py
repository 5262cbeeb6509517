"""Abandoned requests without Ray (``omni_serve.graph.abandoned``): the ingress marks a request that ends with calls
still open (and only then), and a stage replica cancels the calls it still runs for a marked request (and only
those, once they are a period old). The directory is a set here; tests/integration/test_abandoned_calls.py does it on
a served graph."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from omni_serve.api.errors import OpenAIError
from omni_serve.graph.abandoned import AbandonedCalls
from omni_serve.graph.calls import StageCalls
from omni_serve.transport.memory import MemoryConnector


@pytest.fixture
def toy_family(toy, tmp_path):
    from omni_serve.cli import main

    ckpt = str(tmp_path / "toy-tiny")
    main(["make-checkpoint", "toy", "--size", "tiny", ckpt])
    return toy, toy.validate({"checkpoint": ckpt})


class Call:
    """A stage call that yields ``outputs`` then ends, or (``outputs`` None) never answers."""

    def __init__(self, outputs=None):
        self.outputs, self.cancelled = outputs, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.outputs is None:
            await asyncio.sleep(3600)
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop(0)

    def cancel(self):
        self.cancelled = True


def _run(toy_family, outputs: dict, timeout_s: float = 600.0) -> tuple[list[str], dict[str, Call], Exception | None]:
    """Stream request ``r1`` over ``Call(outputs[stage])`` per stage; (the requests marked abandoned, the calls
    opened, what the stream raised)."""
    from tests.toy_family.messages import EchoCall

    family, spec = toy_family
    marked: list[str] = []
    opened: dict[str, Call] = {}

    def open_call(stage, call):
        opened[stage] = Call(outputs[stage])
        return opened[stage]

    calls = StageCalls(family.graph, spec, open_call, probe=None, connector=MemoryConnector())
    calls.on_abandoned = marked.append

    async def main():
        async for _ in calls.stream("r1", {s: EchoCall(request_id="r1", text="x") for s in outputs},
                                    timeout_s=timeout_s):
            pass

    try:
        asyncio.run(main())
    except OpenAIError as exc:
        return marked, opened, exc
    return marked, opened, None


def test_a_request_whose_calls_all_ended_is_not_marked(toy_family):
    from tests.toy_family.messages import Echoed

    marked, _, error = _run(toy_family, {"encode": [], "decode": [Echoed(text="x")]})
    assert error is None and marked == []


def test_a_request_ending_with_a_call_still_open_is_marked_and_the_call_cancelled(toy_family):
    # its deadline passes while decode never answers
    marked, opened, error = _run(toy_family, {"encode": [], "decode": None}, timeout_s=0.3)
    assert error is not None and error.status_code == 504
    assert marked == ["r1"] and opened["decode"].cancelled


def _replica(period_s: float, lookup) -> tuple[AbandonedCalls, Any]:
    """A replica's ``AbandonedCalls`` over ``lookup``, and a call it tracks (``call(request_id, seconds)``)."""
    abandoned = AbandonedCalls("s", lookup=lookup, period_s=period_s)

    async def call(request_id: str, seconds: float) -> str:
        with abandoned.track(request_id):
            await asyncio.sleep(seconds)
        return "finished"

    return abandoned, call


def test_a_replica_cancels_only_the_old_calls_of_marked_requests():
    abandoned_ids = {"gone"}
    asked: list[list[str]] = []

    async def lookup(request_ids):
        asked.append(request_ids)
        return [r for r in request_ids if r in abandoned_ids]

    abandoned, call = _replica(0.2, lookup)

    async def main():
        tasks = {rid: asyncio.create_task(call(rid, 5.0)) for rid in ("gone", "alive")}
        await asyncio.sleep(0.05)
        assert await abandoned.check() == 0 and asked == []  # younger than a period: nothing asked
        done, _ = await asyncio.wait(tasks.values(), timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        assert done == {tasks["gone"]} and tasks["gone"].cancelled()
        assert not tasks["alive"].done()
        tasks["alive"].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        abandoned.close()

    asyncio.run(main())
    assert abandoned.cancelled == 1 and asked and all(sorted(k) == k for k in asked)


def test_an_unreachable_directory_cancels_nothing():
    async def lookup(request_ids):
        raise ConnectionError("directory down")

    abandoned, call = _replica(0.05, lookup)

    async def main():
        result = await call("r", 0.3)
        abandoned.close()
        return result

    assert asyncio.run(main()) == "finished" and abandoned.cancelled == 0


def test_the_watcher_starts_again_and_a_call_younger_than_a_period_runs_on():
    async def lookup(request_ids):
        return [r for r in request_ids if r == "gone"]

    abandoned, call = _replica(0.2, lookup)

    async def main():
        assert await call("first", 0.05) == "finished"
        await asyncio.sleep(0.5)
        assert abandoned._watcher.done()  # no call left: it stopped
        assert await call("gone", 0.1) == "finished"  # never a period old: never asked about
        old = asyncio.create_task(call("gone", 5.0))  # the watcher runs again and cancels it
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(old, 2.0)
        abandoned.close()

    asyncio.run(main())
    assert abandoned.cancelled == 1
