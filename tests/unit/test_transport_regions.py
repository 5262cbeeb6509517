"""The registered-buffer allocator of the Mooncake connectors."""

from __future__ import annotations

import random

from omni_serve.transport.regions import ALIGN, RegionPool


def test_first_fit_alignment_exhaustion_and_coalescing():
    pool = RegionPool(1024)
    a, b, c = pool.allocate(100), pool.allocate(1), pool.allocate(256)
    assert (a, b, c) == (0, 128, 192) and all(x % ALIGN == 0 for x in (a, b, c))
    assert pool.allocate(1024) is None  # does not fit next to what is held
    pool.free(b)
    pool.free(b)  # idempotent
    assert pool.allocate(64) == 128  # the hole is reused first
    for x in (a, 128, c):
        pool.free(x)
    assert pool.used_bytes == 0 and pool.num_regions == 0
    assert pool.allocate(1024) == 0  # every hole coalesced back into one


def test_random_churn_never_overlaps_and_returns_everything():
    rng = random.Random(0)
    pool = RegionPool(1 << 16)
    held: dict[int, int] = {}
    for _ in range(2000):
        if held and rng.random() < 0.5:
            off = rng.choice(list(held))
            pool.free(off)
            del held[off]
        else:
            n = rng.randint(1, 4096)
            off = pool.allocate(n)
            if off is not None:
                assert all(off + n <= o or o + m <= off for o, m in held.items())
                held[off] = n
    for off in held:
        pool.free(off)
    assert pool.used_bytes == 0 and pool.allocate(1 << 16) == 0
