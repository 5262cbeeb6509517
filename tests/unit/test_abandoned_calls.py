"""Abandoned requests without Ray (``omni_serve.graph.abandoned``): the ingress marks a request that ends with calls
still open (and only then), and a stage replica cancels the calls it still runs for a marked request (and only
those, once they are a period old). The directory is a set here; tests/integration/test_abandoned_calls.py does it on
a served graph."""

from __future__ import annotations

import asyncio

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


def _run(toy_family, make_call, timeout_s=600.0):
    from tests.toy_family.messages import EchoCall

    family, spec = toy_family
    marked: list[str] = []
    calls = StageCalls(family.graph, spec, lambda stage, call: make_call(stage), probe=None,
                       connector=MemoryConnector())
    calls.on_abandoned = marked.append

    async def main():
        async for _ in calls.stream("r1", {"encode": EchoCall(request_id="r1", text="x"),
                                           "decode": EchoCall(request_id="r1", text="x")}, timeout_s=timeout_s):
            pass

    return asyncio.run(main()), marked


def test_a_request_whose_calls_all_ended_is_not_marked(toy_family):
    from tests.toy_family.messages import Echoed

    _, marked = _run(toy_family, lambda stage: Call([Echoed(text="x")] if stage == "decode" else []))
    assert marked == []


def test_a_request_ending_with_a_call_still_open_is_marked_and_the_call_cancelled(toy_family):
    from tests.toy_family.messages import EchoCall

    family, spec = toy_family
    marked: list[str] = []
    opened: list[Call] = []

    def open_call(stage, call):
        opened.append(Call(None if stage == "decode" else []))
        return opened[-1]

    calls = StageCalls(family.graph, spec, open_call, probe=None, connector=MemoryConnector())
    calls.on_abandoned = marked.append

    async def main():
        async for _ in calls.stream("r2", {s: EchoCall(request_id="r2", text="x") for s in ("encode", "decode")},
                                    timeout_s=0.3):
            pass

    with pytest.raises(OpenAIError) as err:  # its deadline passes while decode never answers
        asyncio.run(main())
    assert err.value.status_code == 504 and marked == ["r2"] and opened[1].cancelled


def test_a_replica_cancels_only_the_old_calls_of_marked_requests():
    abandoned_ids = {"gone"}
    asked: list[list[str]] = []

    async def lookup(request_ids):
        asked.append(request_ids)
        return [r for r in request_ids if r in abandoned_ids]

    abandoned = AbandonedCalls("s", lookup=lookup, period_s=0.2)

    async def call(request_id, seconds):
        with abandoned.track(request_id):
            await asyncio.sleep(seconds)
        return "finished"

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

    abandoned = AbandonedCalls("s", lookup=lookup, period_s=0.05)

    async def main():
        async def call():
            with abandoned.track("r"):
                await asyncio.sleep(0.3)
            return "finished"

        result = await call()
        abandoned.close()
        return result

    assert asyncio.run(main()) == "finished" and abandoned.cancelled == 0


def test_the_watcher_starts_again_and_a_call_younger_than_a_period_runs_on():
    async def lookup(request_ids):
        return [r for r in request_ids if r == "gone"]

    abandoned = AbandonedCalls("s", lookup=lookup, period_s=0.2)

    async def call(request_id, seconds):
        with abandoned.track(request_id):
            await asyncio.sleep(seconds)
        return "finished"

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
