"""Models a ``RankGroup`` builds on each rank in ``tests/integration/test_rank_group.py``."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


class DiTRows:
    """Qwen-Image's DiT on every rank; ``forward(n)`` runs ``n`` deterministic rows row-parallel over the group."""

    def __init__(self, checkpoint: str):
        from tests.unit.test_parallel import _inputs

        self.checkpoint, self.inputs = checkpoint, _inputs

    def forward(self, n: int):
        from omni_serve.parallel.rows import row_parallel
        from tests.unit.test_parallel import _forward

        model, *rest = self.inputs(self.checkpoint, n)
        return row_parallel(lambda idx: _forward(model, *rest, idx), torch.arange(n)).numpy()

    def where(self) -> dict:
        import ray

        pg = ray.util.get_current_placement_group()
        return {"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(),
                "placement_group": pg.id.hex() if pg is not None else None}
