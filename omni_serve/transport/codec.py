"""Payload layout for the byte-moving backends (shared memory, Mooncake): one header + one flat tensor area.

Contract:
- ``encode(payload) -> Encoded``: the payload (any picklable structure; its torch tensors anywhere inside)
  becomes ``header`` (small pickled bytes in which every tensor is a placeholder) and ``tensors`` laid out
  at 64-byte aligned ``offsets`` of an area of ``nbytes``. ``Encoded.write_into(buffer)`` copies the tensor
  bytes into any writable buffer of at least ``nbytes``.
- ``decode(header, area)`` rebuilds the payload with tensors that are **views** of ``area`` (zero-copy;
  the tensors keep ``area`` alive, so a backend can release the memory when the last view dies).

Why pickle with persistent ids and not ``torch.save``/``ray.put``: tensors stay out of the pickle stream,
so they are copied exactly once (into the transport buffer) and read with no copy at all.
Tensors are moved to CPU and made contiguous (the data plane carries host memory on these backends).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

ALIGN = 64
COPY_IN_THREAD = 8 << 20  # payloads above this are copied off the event loop


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Encoded:
    header: bytes
    tensors: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0

    def write_into(self, buffer) -> None:
        """Copy every tensor into ``buffer`` (writable, at least ``nbytes``) at its offset."""
        if not self.tensors:
            return
        area = torch.frombuffer(buffer, dtype=torch.uint8, count=self.nbytes)
        for tensor, offset in zip(self.tensors, self.offsets):
            n = tensor.numel() * tensor.element_size()
            if n:
                area[offset:offset + n].copy_(tensor.reshape(-1).view(torch.uint8))


async def write_into(enc: Encoded, buffer) -> None:
    """``enc.write_into(buffer)``; large payloads are copied in a worker thread (the event loop keeps serving)."""
    if enc.nbytes > COPY_IN_THREAD:
        from omni_serve.transport.base import in_thread

        await in_thread(enc.write_into, buffer)
    else:
        enc.write_into(buffer)


class _Pickler(pickle.Pickler):
    def __init__(self, file, encoded: Encoded):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.encoded = encoded

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        enc = self.encoded
        t = obj.detach().to("cpu").contiguous()
        # Views must not drag their whole base storage along: reading ``t``'s own bytes only.
        offset = enc.nbytes
        enc.tensors.append(t)
        enc.offsets.append(offset)
        enc.nbytes = _aligned(offset + t.numel() * t.element_size())
        return ("tensor", offset, tuple(t.shape), str(t.dtype).removeprefix("torch."), obj.requires_grad)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, area):
        super().__init__(file)
        self.area = area

    def persistent_load(self, pid):
        kind, offset, shape, dtype, requires_grad = pid
        if kind != "tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
        dt = getattr(torch, dtype)
        count = 1
        for d in shape:
            count *= d
        if count == 0:
            return torch.empty(shape, dtype=dt)
        t = torch.frombuffer(self.area, dtype=dt, count=count, offset=offset).view(shape)
        return t.requires_grad_(requires_grad) if requires_grad else t


def encode(payload: Any) -> Encoded:
    enc = Encoded(header=b"")
    buf = io.BytesIO()
    _Pickler(buf, enc).dump(payload)
    enc.header = buf.getvalue()
    return enc


def decode(header: bytes, area) -> Any:
    """The payload; its tensors are views of ``area`` (a writable buffer: memoryview, mmap slice...)."""
    return _Unpickler(io.BytesIO(header), area).load()
