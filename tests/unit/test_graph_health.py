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
