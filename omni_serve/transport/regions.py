"""A fixed host buffer carved into payload regions: the registered memory of the Mooncake connectors.

Contract: ``RegionPool(nbytes)`` allocates one ``uint8`` buffer once (so it can be registered with a
transfer engine once: registration per payload costs more than small transfers; pages are touched lazily).
``allocate(n) -> offset | None`` hands out ``n`` bytes (64-byte aligned, first fit), ``free(offset)``
returns them (neighbours coalesce). ``address(offset)`` is the raw pointer for the engine, ``view(offset,
n)`` a writable memoryview. Thread-safe: engines complete transfers on their own threads.

Why our own allocator: the buffer must be one registered block; Python has no first-fit arena over a
caller-provided buffer, and payload sizes here span 4 KiB to GiBs.
"""

from __future__ import annotations

import bisect
import threading

import numpy as np

ALIGN = 64


class RegionPool:
    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.buffer = np.zeros(nbytes, dtype=np.uint8)
        self.base = self.buffer.ctypes.data
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, size)
        self._used: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(self._used.values())

    @property
    def num_regions(self) -> int:
        with self._lock:
            return len(self._used)

    def allocate(self, n: int) -> int | None:
        size = max(ALIGN, -(-n // ALIGN) * ALIGN)
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + size, free - size)
                    self._used[offset] = size
                    return offset
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._used.pop(offset, None)
            if size is None:
                return  # already freed (idempotent: several cleanup paths may race)
            i = bisect.bisect(self._free, (offset, size))
            self._free.insert(i, (offset, size))
            # coalesce with the next, then the previous neighbour
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                prev = self._free.pop(i - 1)
                self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def address(self, offset: int) -> int:
        return self.base + offset

    def view(self, offset: int, n: int) -> memoryview:
        return memoryview(self.buffer)[offset:offset + n]
