"""diffusers' context (sequence) parallelism on any ranks, CPU ones included.

Contract: ``enable_context_parallel(transformer, degree)`` applies diffusers' Ulysses context parallelism
(``ContextParallelConfig(ulysses_degree=degree, ulysses_anything=True)``: any sequence length, attention masks
kept) to a diffusers transformer that has a context-parallel plan (``_cp_plan``: Qwen-Image's), inside an
initialized ``torch.distributed`` group of ``degree`` ranks that all run the same forward. Each rank then holds a
share of the sequence through the blocks and the output is gathered: equal to one rank's within float32 rounding.

The work-around, here and nowhere else: diffusers 0.42 resolves the rank's device as ``rank %
torch.accelerator.device_count()``, a division by zero where torch has no accelerator (a CPU build, gloo ranks).
While it resolves, the count reads at least 1, so a CPU rank resolves to the ``cpu`` device it is on.
``tests/unit/test_parallel.py`` fails once diffusers no longer needs it. On gloo the image tokens must split evenly
across the ranks (gloo's all-gather takes equal shards; text of any length is padded by ``ulysses_anything``).
Ring attention (the other kind) needs an attention op that returns the log-sum-exp, CUDA-only in this torch: not
offered.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def accelerator_count_at_least_one() -> Iterator[None]:
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(1, real())
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def enable_context_parallel(transformer, degree: int) -> None:
    from diffusers import ContextParallelConfig

    if getattr(transformer, "_cp_plan", None) is None:
        raise ValueError(f"{type(transformer).__name__} has no context-parallel plan in diffusers; use row "
                         "parallelism (omni_serve.parallel.rows) for it")
    with accelerator_count_at_least_one():
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=degree, ulysses_anything=True))
