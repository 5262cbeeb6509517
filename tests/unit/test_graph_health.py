"""The ingress' cached graph health (``omni_serve.deployments.health``): one probe per period however often it is
asked, never two at once, fresh on request."""

from __future__ import annotations

import asyncio

from omni_serve.deployments.health import GraphHealth


def test_a_flood_of_health_calls_costs_one_probe_per_period():
    probes = []

    async def stages():
        probes.append(1)
        await asyncio.sleep(0.05)
        return {"thinker": {"active": len(probes)}}

    async def data_plane():
        return {"directory": "ok"}

    async def main():
        health = GraphHealth(stages, data_plane, ttl_s=0.3)
        answers = await asyncio.gather(*(health.get() for _ in range(500)))
        assert len(probes) == 1 and all(a == answers[0] for a in answers)
        await asyncio.sleep(0.35)  # stale: the next call answers at once and refreshes in the background
        stale = await health.get()
        assert stale[0]["thinker"]["active"] == 1
        await asyncio.gather(*(health.get() for _ in range(100)))
        await asyncio.sleep(0.1)
        assert len(probes) == 2 and (await health.get())[0]["thinker"]["active"] == 2
        assert (await health.get(fresh=True))[0]["thinker"]["active"] == 3  # an operator's fresh look
        assert health.refreshes == 3

    asyncio.run(main())


def test_a_slow_directory_is_slow_until_it_has_not_answered_for_the_stale_period(monkeypatch):
    """A ping unanswered within the timeout reports the last answer ("slow", not an error, so no 503) while the
    directory answered within ``stale_s``; past that, or when the ping errs, it is an error."""
    import time

    from omni_serve.deployments import health
    from omni_serve.transport import directory as directory_module

    delay = {"s": 0.0, "fail": False}

    class Directory:
        async def call(self, method):
            assert method == "size"
            if delay["fail"]:
                raise RuntimeError("ActorDiedError: the directory actor died\nThe actor is dead")
            await asyncio.sleep(delay["s"])
            return 7

    monkeypatch.setattr(directory_module, "directory", lambda: Directory())
    monkeypatch.setattr(health._LastAnswer, "at", float("-inf"))

    async def state():
        return await health.directory_state(timeout_s=0.05, stale_s=10.0)

    delay["s"] = 0.2
    assert "error" in asyncio.run(state())  # never answered: down
    delay["s"] = 0.0
    assert asyncio.run(state()) == {"directory": "ok", "entries": 7}
    delay["s"] = 0.2
    slow = asyncio.run(state())
    assert slow["directory"] == "slow" and slow["entries"] == 7 and "error" not in slow
    monkeypatch.setattr(health._LastAnswer, "at", time.monotonic() - 11)
    assert "did not answer" in asyncio.run(state())["error"]  # no answer for longer than stale_s
    delay["fail"] = True
    assert asyncio.run(state())["error"] == "the data directory is unreachable: The actor is dead"
