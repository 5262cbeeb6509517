"""Sequence (context) parallelism for a packed DiT forward: each rank holds a contiguous share of the image tokens.

Contract: ``SequenceShards(group)`` (inside an initialized ``torch.distributed`` group whose ranks all run the same
forward on the same rows) says which image tokens this rank holds (``share(n)``: ``row_range`` of the ``n`` tokens;
shares differ by at most one, any ``n``) and gathers a tensor sharded that way back whole on every rank
(``gather(local, n, dim)``). The forward that uses it (``omni_serve.models.qwen_image_packed.PackedForward``) keeps
each rank's share of the image stream through the blocks (every projection, MLP and modulation is per token), keeps
the short text stream whole on every rank, and before each joint attention gathers the image keys and values: each
rank attends its image queries and all text queries over every key, so the result equals one rank's up to float
rounding. The output is gathered at the end.

Why not diffusers' context parallelism (``omni_serve.parallel.context``, Ulysses): its hooks sit on the modules'
forwards, which the served packed forward does not call (it calls the blocks' submodules directly, on rows packed
without padding), and on gloo it needs image tokens that split evenly. Gathering keys and values (rather than
Ulysses' head all-to-all) needs no head count the degree divides and no equal shares; it moves the image keys and
values once per block, which at two to four ranks is what Ulysses' four all-to-alls move too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from omni_serve.parallel.rows import gather_shares, row_range


class SequenceShards:
    def __init__(self, group=None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.tokens = self.held = 0  # image tokens of the forwards so far, and how many of them this rank held

    def share(self, n: int) -> range:
        """The tokens (of ``n``) this rank holds in one forward (counted in ``tokens`` and ``held``)."""
        mine = row_range(n, self.rank, self.world)
        self.tokens += n
        self.held += len(mine)
        return mine

    def gather(self, local: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        """Every rank's share (``local``: this rank's) of ``n`` tokens along ``dim``, whole, on every rank."""
        return gather_shares(local.contiguous(), n, dim, self.group)
