"""Row parallelism: a step's rows (requests, CFG branches) split across the ranks of a group, then gathered.

Contract: ``row_range(n, rank, world)`` is the contiguous share of ``n`` rows that ``rank`` computes (the first
``n % world`` ranks take one more; a rank may get none). ``row_parallel(fn, rows, group)`` runs ``fn`` on this
rank's share of ``rows`` (a tensor, rows on dim 0) and returns every rank's results concatenated in row order, the
same on every rank; ``fn`` must map ``k`` rows to ``k`` result rows independently of the others (a DiT forward
does: attention never crosses rows), so the result equals ``fn(rows)`` on one rank. With fewer rows than ranks,
every rank computes them all (nothing to split). This is CFG parallelism generalised: two CFG branches are two
rows. ``gather_shares(local, n, dim)`` is its all-gather: every rank's share along any dimension, put back together.

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


def gather_shares(local: torch.Tensor, n: int, dim: int = 0, group=None) -> torch.Tensor:
    """Every rank's ``row_range`` share of ``n`` along ``dim`` (``local``: this rank's), concatenated in rank order,
    the same on every rank. Shares may differ by one (or be empty): each is padded to the widest for the all-gather
    (gloo's takes equal sizes) and trimmed after, so padding never reaches the result."""
    world = dist.get_world_size(group)
    widest = len(row_range(n, 0, world))
    shape = list(local.shape)
    shape[dim] = widest
    padded = local.new_zeros(shape)
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([g.narrow(dim, 0, len(row_range(n, r, world))) for r, g in enumerate(gathered)], dim=dim)


def row_parallel(fn: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, group=None) -> torch.Tensor:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = rows.shape[0]
    if n < world:
        return fn(rows)
    mine = row_range(n, rank, world)
    return gather_shares(fn(rows[mine.start:mine.stop]), n, 0, group)
