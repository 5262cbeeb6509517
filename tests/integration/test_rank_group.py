"""A replica that owns a group of ranks (``omni_serve.parallel.group``), in Ray Serve: the deployment reserves the
replica's bundle and one per rank (``placement_group_bundles``), the ranks start in that placement group, form a
gloo group, and step together: Qwen-Image's DiT rows split over two ranks equal one process (the collective
building block of the kinds that need a process group; a rank lost in a served stage is in
``test_parallel_stages.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omni_serve.parallel.group import rank_bundles

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def group_app(ray_serve, qwen_image_tiny_dir):
    from ray import serve

    @serve.deployment(placement_group_bundles=rank_bundles({"CPU": 0.01}, 0.01, 2), placement_group_strategy="STRICT_PACK",
                      ray_actor_options={"num_cpus": 0.01}, health_check_period_s=1, health_check_timeout_s=10)
    class GroupHost:
        def __init__(self, checkpoint: str):
            from omni_serve.parallel.group import RankGroup

            self.group = RankGroup(2, "tests.integration.rank_models:DiTRows", (checkpoint,), num_cpus=0.01)

        async def forward(self, n: int):
            return (await self.group.call("forward", n))[0]

        async def where(self):
            import ray

            pg = ray.util.get_current_placement_group()
            return {"replica_pg": pg.id.hex() if pg else None, "ranks": await self.group.call("where")}

        def check_health(self):
            if not self.group.alive():
                raise RuntimeError("a rank of the group was lost")

        def __del__(self):
            self.group.shutdown()

    handle = serve.run(GroupHost.bind(qwen_image_tiny_dir), name="rank_group", route_prefix=None)
    yield handle
    serve.delete("rank_group")


def test_the_ranks_live_in_the_replicas_placement_group_and_step_together(group_app, qwen_image_tiny_dir):
    from tests.unit.test_parallel import _forward, _inputs, _rel

    where = group_app.where.remote().result(timeout_s=120)
    assert where["replica_pg"] is not None
    assert [r["rank"] for r in where["ranks"]] == [0, 1] and {r["world"] for r in where["ranks"]} == {2}
    assert {r["placement_group"] for r in where["ranks"]} == {where["replica_pg"]}
    model, *rest = _inputs(qwen_image_tiny_dir, 3)
    one = _forward(model, *rest, torch.arange(3)).numpy()
    got = group_app.forward.remote(3).result(timeout_s=120)
    assert _rel(np.asarray(got), one) < 1e-5
