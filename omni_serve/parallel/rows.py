"""Row parallelism: a step's rows (requests, CFG branches) split across the ranks of a group, then gathered.

Contract: ``row_range(n, rank, world)`` is the contiguous share of ``n`` rows that ``rank`` computes (the first
``n % world`` ranks take one more; a rank may get none). ``row_parallel(fn, rows, group)`` runs ``fn`` on this
rank's share of ``rows`` (a tensor, rows on dim 0) and returns every rank's results concatenated in row order, the
same on every rank; ``fn`` must map ``k`` rows to ``k`` result rows independently of the others (a DiT forward
does: attention never crosses rows), so the result equals ``fn(rows)`` on one rank. With fewer rows than ranks,
every rank computes them all (nothing to split). This is CFG parallelism generalised: two CFG branches are two
rows.

Why our own: xfuser's CFG parallel is a hook around exactly this all-gather but does not import without a GPU;
the all-gather of uneven shares (padded to the largest, then trimmed) is all there is to it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


def row_range(n: int, rank: int, world: int) -> range:
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def row_parallel(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, group=None) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = rows.shape[0]
    if n < world:
        return fn(rows)
    mine = row_range(n, rank, world)
    widest = len(row_range(n, 0, world))
    local = fn(rows[mine.start:mine.stop])
    padded = torch.zeros((widest, *local.shape[1:]), dtype=local.dtype, device=local.device)
    padded[:len(mine)] = local
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return torch.cat([g[:len(row_range(n, r, world))] for r, g in enumerate(gathered)])
