"""Payload layout of the data plane: a JSON header that cannot run code + one flat area of raw bytes.

Contract:
- ``encode(payload) -> Encoded``: ``header`` (UTF-8 JSON) describes the payload; its tensors and byte strings
  are laid out at 64-byte aligned ``offsets`` of an area of ``nbytes``. ``Encoded.write_into(buffer)`` copies
  them into any writable buffer of at least ``nbytes`` (the one memcpy of a put); ``Encoded.views()`` are the
  same bytes as zero-copy ``uint8`` arrays (for a backend that copies them itself).
- ``decode(header, area)`` rebuilds the payload: tensors are **views** of ``area`` (zero-copy; they keep
  ``area`` alive, so a backend can release the memory when the last view dies), byte strings are copies.
  ``rebuild(doc, area)`` does the same for a header parsed as part of a larger JSON document (the shared-memory
  index file); ``gather`` rebuilds an area from ``Encoded.views()`` that went through an object store.
- What a payload may be (anything else is refused at put time, ``UnsupportedPayload``): a ``Message``
  (``omni_serve.graph.messages``, which registers its base in ``message_types``: transport never imports
  graphs), a ``torch.Tensor`` (strided, a dtype of ``DTYPES``), ``bytes`` / ``bytearray`` (read back as
  ``bytes``), ``str``, ``int``, ``float``, ``bool``, ``None``, and lists, tuples and dicts (``str`` or ``int``
  keys) of these.
- ``decode`` trusts nothing in the bytes (``RefusedPayload`` on anything malformed): messages are rebuilt
  by name from the ``Message`` subclasses **already imported** in this process (no module named by the
  bytes is ever imported) and validated by pydantic in strict mode; a tensor's dtype comes from a fixed
  table and its bytes must lie inside the area.

Header format (version 1): ``{"v": 1, "p": <node>}``, where a node is a JSON null, boolean, number or string
(itself), a JSON array (a list of nodes), or an object with one tag:

- ``{"T": [dtype, [shape...], offset, requires_grad]}``: a tensor, ``dtype`` a key of ``DTYPES``;
- ``{"B": [offset, length]}``: a byte string;
- ``{"U": [nodes...]}``: a tuple;
- ``{"D": [[key, node], ...]}``: a dict (key a string or an integer);
- ``{"M": "module.QualName", "F": {field: node, ...}}``: a message.

Why not pickle (what this module used before): unpickling bytes runs whatever code they name, and the
data plane's bytes sit in files (shared memory) and buffers (Mooncake) other processes can write. Why not
``torch.save``/``ray.put`` of the payload: tensors stay out of the header, so they are copied exactly once
(into the transport memory) and read with no copy at all. Tensors are moved to CPU and made contiguous.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np
import torch
from pydantic import BaseModel, ValidationError

from omni_serve.transport.base import DataPlaneError
from omni_serve.transport.message_types import message_base

log = logging.getLogger(__name__)
_JSON = json.JSONDecoder()

FORMAT = 1
ALIGN = 64
COPY_IN_THREAD = 8 << 20  # payloads above this are copied off the event loop
MAX_HEADER = 64 << 20  # a larger header is refused unread
MAX_DIMS = 64

_DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz")
#: The tensor dtypes the data plane carries, by header name (this torch's subset of ``_DTYPE_NAMES``).
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
_DTYPE_NAME = {dt: n for n, dt in DTYPES.items()}

SUPPORTED = ("Messages, torch tensors, bytes, str, int, float, bool, None, and lists, tuples and dicts "
             "(str or int keys) of them")


class UnsupportedPayload(DataPlaneError, TypeError):
    """A put of something the data plane does not carry (raised before anything is written)."""


class RefusedPayload(DataPlaneError, ValueError):
    """Bytes read off the data plane that are not a well-formed payload (corrupt, or forged)."""


class refusing:  # ``with codec.refusing(key):``; a class, as it is cheaper than @contextmanager
    """Re-raise a ``RefusedPayload`` with the key it was read under (and log it: forged bytes show up here)."""

    def __init__(self, key: str):
        self.key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None and issubclass(kind, RefusedPayload):
            log.warning("data plane: refused payload %s: %s", self.key, exc)
            raise RefusedPayload(f"data-plane payload {self.key} refused: {exc}") from None


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


Blob = Union[torch.Tensor, bytes, bytearray]


@dataclass
class Encoded:
    header: bytes
    blobs: list[Blob] = field(default_factory=list)  # CPU contiguous tensors and byte strings
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0

    def write_into(self, buffer) -> None:
        """Copy every tensor and byte string into ``buffer`` (writable, at least ``nbytes``) at its offset."""
        if not self.blobs:
            return
        area = torch.frombuffer(buffer, dtype=torch.uint8, count=self.nbytes)
        raw = None
        for blob, offset in zip(self.blobs, self.offsets):
            if isinstance(blob, torch.Tensor):
                n = blob.numel() * blob.element_size()
                if n:
                    area[offset:offset + n].copy_(blob.reshape(-1).view(torch.uint8))
            elif blob:
                raw = raw if raw is not None else _bytes_view(buffer)
                raw[offset:offset + len(blob)] = blob

    def views(self) -> list[np.ndarray]:
        """The tensors' and byte strings' bytes as ``uint8`` arrays, without copying (in ``offsets`` order)."""
        return [blob.reshape(-1).view(torch.uint8).numpy() if isinstance(blob, torch.Tensor)
                else np.frombuffer(blob, dtype=np.uint8) for blob in self.blobs]


def _bytes_view(buffer) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


async def write_into(enc: Encoded, buffer) -> None:
    """``enc.write_into(buffer)``; large payloads are copied in a worker thread (the event loop keeps serving)."""
    if enc.nbytes > COPY_IN_THREAD:
        from omni_serve.transport.base import in_thread

        await in_thread(enc.write_into, buffer)
    else:
        enc.write_into(buffer)


# -- message registry ----------------------------------------------------------------------------------------
# The base class of the messages payloads may be is the graph layer's, registered by it (message_types).
_MESSAGES: dict[str, type[BaseModel]] = {}


def message_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def message_class(name: str) -> type[BaseModel] | None:
    """The ``Message`` subclass of that name among those imported in this process (never imports one)."""
    cls = _MESSAGES.get(name)
    base = message_base()
    if cls is None and base is not None:
        found, stack = {message_name(base): base}, [base]
        while stack:
            for sub in stack.pop().__subclasses__():
                found[message_name(sub)] = sub
                stack.append(sub)
        _MESSAGES.update(found)
        cls = _MESSAGES.get(name)
    return cls


# -- encode --------------------------------------------------------------------------------------------------
class _Encoder:
    def __init__(self):
        self.enc = Encoded(header=b"")

    def _blob(self, blob: Blob, n: int) -> int:
        enc = self.enc
        offset = enc.nbytes
        enc.blobs.append(blob)
        enc.offsets.append(offset)
        enc.nbytes = _aligned(offset + n)
        return offset

    def node(self, value: Any, where: str) -> Any:
        kind = type(value)
        if value is None or kind is bool or kind is int or kind is float or kind is str:
            return value
        if isinstance(value, torch.Tensor):
            return {"T": self._tensor(value, where)}
        if kind is list:
            return [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if kind is dict:
            return {"D": [[self._key(k, where), self.node(v, f"{where}[{k!r}]")] for k, v in value.items()]}
        if kind is tuple:
            return {"U": [self.node(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if kind is bytes or kind is bytearray:
            return {"B": [self._blob(value, len(value)), len(value)]}
        if isinstance(value, BaseModel):
            base = message_base()
            if base is not None and isinstance(value, base):
                cls = type(value)
                name = message_name(cls)
                _MESSAGES[name] = cls
                return {"M": name, "F": {f: self.node(getattr(value, f), f"{where}.{f}") for f in cls.model_fields}}
        what = "a pydantic model that is not a Message" if isinstance(value, BaseModel) else "that type"
        raise UnsupportedPayload(
            f"the data plane cannot carry {kind.__module__}.{kind.__qualname__} (at {where}: {what}); it "
            f"carries {SUPPORTED}")

    def _key(self, key: Any, where: str) -> Any:
        if type(key) is str or type(key) is int:
            return key
        raise UnsupportedPayload(f"the data plane carries dicts with str or int keys, not {type(key).__name__} "
                                 f"(at {where})")

    def _tensor(self, tensor: torch.Tensor, where: str) -> list:
        name = _DTYPE_NAME.get(tensor.dtype)
        if name is None or tensor.layout is not torch.strided:
            raise UnsupportedPayload(f"the data plane cannot carry a {tensor.dtype} {tensor.layout} tensor (at "
                                     f"{where}); dense tensors of {sorted(DTYPES)} only")
        requires_grad = tensor.requires_grad
        # Each step only where needed: these calls cost microseconds each, on every put of a stream's chunks.
        t = tensor.detach() if requires_grad else tensor
        if t.device.type != "cpu":
            t = t.to("cpu")
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        if not t.is_contiguous():
            t = t.contiguous()
        # Views must not drag their whole base storage along: ``t``'s own bytes only.
        offset = self._blob(t, t.numel() * t.element_size())
        return [name, list(t.shape), offset, requires_grad]


def encode(payload: Any) -> Encoded:
    """The header and the bytes of ``payload``; ``UnsupportedPayload`` names the first part it cannot carry."""
    encoder = _Encoder()
    body = encoder.node(payload, "payload")
    encoder.enc.header = json.dumps({"v": FORMAT, "p": body}, separators=(",", ":")).encode()
    return encoder.enc


# -- decode --------------------------------------------------------------------------------------------------
class _Decoder:
    def __init__(self, area):
        self.area = area
        self.size = memoryview(area).nbytes

    def node(self, node: Any) -> Any:
        kind = type(node)
        if node is None or kind is bool or kind is int or kind is float or kind is str:
            return node
        if kind is list:
            return [self.node(n) for n in node]
        if kind is dict:
            if len(node) == 1:
                tag, body = next(iter(node.items()))
                if tag == "T":
                    return self._tensor(body)
                if tag == "B":
                    return self._bytes(body)
                if tag == "U" and type(body) is list:
                    return tuple(self.node(n) for n in body)
                if tag == "D" and type(body) is list:
                    return self._dict(body)
            elif node.keys() == {"M", "F"}:
                return self._message(node["M"], node["F"])
            raise RefusedPayload(f"payload header: unknown node {_short(node)}")
        raise RefusedPayload(f"payload header: unexpected {kind.__name__}")

    def _span(self, offset: Any, n: int, what: str) -> None:
        if type(offset) is not int or offset < 0 or offset % ALIGN or offset + n > self.size:
            raise RefusedPayload(f"payload header: {what} at offset {_short(offset)} ({n} bytes) is not an aligned "
                                 f"range of the payload's {self.size} bytes")

    def _tensor(self, body: Any) -> torch.Tensor:
        if type(body) is not list or len(body) != 4:
            raise RefusedPayload(f"payload header: malformed tensor {_short(body)}")
        name, shape, offset, requires_grad = body
        dtype = DTYPES.get(name) if type(name) is str else None
        if dtype is None:
            raise RefusedPayload(f"payload header: unknown tensor dtype {_short(name)}")
        if type(shape) is not list or len(shape) > MAX_DIMS or type(requires_grad) is not bool:
            raise RefusedPayload(f"payload header: malformed tensor {_short(body)}")
        count = 1
        for d in shape:
            if type(d) is not int or d < 0:
                raise RefusedPayload(f"payload header: malformed tensor {_short(body)}")
            count *= d
        self._span(offset, count * dtype.itemsize, "a tensor")
        if count == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(self.area, dtype=dtype, count=count, offset=offset).view(shape)
        if requires_grad:
            if not (dtype.is_floating_point or dtype.is_complex):
                raise RefusedPayload(f"payload header: a {name} tensor cannot require grad")
            t.requires_grad_(True)
        return t

    def _bytes(self, body: Any) -> bytes:
        if type(body) is not list or len(body) != 2 or type(body[1]) is not int or body[1] < 0:
            raise RefusedPayload(f"payload header: malformed byte string {_short(body)}")
        offset, n = body
        self._span(offset, n, "a byte string")
        return bytes(_bytes_view(self.area)[offset:offset + n]) if n else b""

    def _dict(self, pairs: list) -> dict:
        out = {}
        for pair in pairs:
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (str, int):
                raise RefusedPayload(f"payload header: malformed dict item {_short(pair)}")
            out[pair[0]] = self.node(pair[1])
        return out

    def _message(self, name: Any, fields: Any) -> BaseModel:
        cls = message_class(name) if type(name) is str else None
        if cls is None:
            raise RefusedPayload(f"payload header: {_short(name)} is not a message class known to this process")
        if type(fields) is not dict:
            raise RefusedPayload(f"payload header: malformed fields of {name}")
        values = {k: self.node(v) for k, v in fields.items()}
        try:
            return cls.model_validate(values, strict=True)
        except ValidationError as exc:
            raise RefusedPayload(f"payload header: invalid {name}: {exc}") from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_json(text: bytes, what: str = "payload header") -> Any:
    """``text`` as JSON (``RefusedPayload`` if it is not, or is larger than ``MAX_HEADER``)."""
    if len(text) > MAX_HEADER:
        raise RefusedPayload(f"{what} of {len(text)} bytes refused (more than {MAX_HEADER})")
    try:
        return _JSON.decode(text.decode())
    except (ValueError, RecursionError) as exc:
        raise RefusedPayload(f"{what} is not JSON: {exc}") from None


def decode(header: bytes, area) -> Any:
    """The payload of ``header``; its tensors are views of ``area`` (a writable buffer: memoryview, mmap slice,
    array). ``RefusedPayload`` when the header is not a well-formed payload of this format."""
    return rebuild(parse_json(header), area)


def rebuild(doc: Any, area) -> Any:
    """``decode`` of a header already parsed (e.g. as part of a larger JSON document)."""
    if type(doc) is not dict or doc.keys() != {"v", "p"} or doc["v"] != FORMAT:
        raise RefusedPayload(f"payload header is not format {FORMAT}: {_short(doc)}")
    try:
        return _Decoder(area).node(doc["p"])
    except RecursionError:
        raise RefusedPayload("payload header nests too deeply") from None


def gather(nbytes: int, offsets: Any, parts: Any) -> np.ndarray:
    """A fresh area of ``nbytes`` holding each of ``parts`` (``Encoded.views()`` after a trip through a store
    that returns read-only buffers) at its offset: one copy, and tensors ``decode``d from it are writable."""
    if (type(nbytes) is not int or nbytes < 0 or not isinstance(offsets, (list, tuple))
            or not isinstance(parts, (list, tuple)) or len(offsets) != len(parts)):
        raise RefusedPayload("malformed payload parts")
    area = np.empty(nbytes, dtype=np.uint8)
    for offset, part in zip(offsets, parts):
        if (not isinstance(part, np.ndarray) or part.dtype != np.uint8 or part.ndim != 1
                or type(offset) is not int or offset < 0 or offset + part.size > nbytes):
            raise RefusedPayload("malformed payload part")
        area[offset:offset + part.size] = part
    return area
