"""The data plane's payload codec: a typed JSON header + raw bytes; what it carries, and what it refuses to read.

Every decode case here is bytes another process could have written: none may import a module, run code, or
build anything but a validated message / tensor view / primitive."""

from __future__ import annotations

import json
import pickle
import sys

import numpy as np
import pytest
import torch
from pydantic import BaseModel

from omni_serve.graph.messages import Message, StreamChunk, Tensor
from omni_serve.transport import codec
from omni_serve.transport.base import DataPlaneError
from omni_serve.transport.codec import RefusedPayload, UnsupportedPayload


class Inner(Message):
    t: Tensor
    n: int


class Outer(StreamChunk):
    inner: Inner | None = None
    extra: Tensor | None = None
    codes: list[int] = []
    blobs: list[bytes] = []
    ratio: float = 1.0
    name: str = ""


class SubInner(Inner):  # a subclass: rebuilt as itself, not as its base
    tag: str = "sub"


def round_trip(payload):
    enc = codec.encode(payload)
    area = bytearray(enc.nbytes)
    enc.write_into(area)
    return codec.decode(enc.header, memoryview(area)), enc, area


def header(body) -> bytes:
    return json.dumps({"v": codec.FORMAT, "p": body}).encode()


def test_messages_round_trip_as_their_own_classes_with_tensor_views():
    x = torch.arange(12, dtype=torch.float32).view(3, 4)
    msg = Outer(inner=Inner(t=x[:, :2], n=3), extra=torch.ones(2, dtype=torch.bfloat16), codes=[1, 2],
                blobs=[b"\x00\x01", b""], ratio=float("inf"), name="é", end=True)
    out, enc, area = round_trip(msg)
    assert type(out) is Outer and type(out.inner) is Inner and out.inner.n == 3
    assert torch.equal(out.inner.t, x[:, :2]) and out.extra.dtype == torch.bfloat16
    assert (out.codes, out.blobs, out.ratio, out.name, out.end) == ([1, 2], [b"\x00\x01", b""], float("inf"), "é", True)
    assert all(o % codec.ALIGN == 0 for o in enc.offsets)
    # the header is plain JSON, the tensor a view of the area
    assert json.loads(enc.header)["p"]["M"] == f"{__name__}.Outer"
    area[enc.offsets[0]:enc.offsets[0] + 4] = torch.tensor([42.0]).numpy().tobytes()
    assert out.inner.t[0, 0] == 42.0
    sub, _, _ = round_trip({"m": SubInner(t=x, n=1, tag="s")})
    assert type(sub["m"]) is SubInner and sub["m"].tag == "s"


def test_plain_structures_dtypes_and_grad_round_trip():
    payload = {"f": torch.randn(3, requires_grad=True), "b": torch.tensor([True, False]),
               "c": torch.tensor([1 + 2j]).conj(), "u8": torch.arange(5, dtype=torch.uint8), "t": (1, [2.5, None], "s"),
               7: {"nested": [torch.zeros(0, 3)]}, "raw": b"abc", "ba": bytearray(b"xy")}
    out, _, _ = round_trip(payload)
    assert out["f"].requires_grad and torch.equal(out["f"].detach(), payload["f"].detach())
    assert torch.equal(out["b"], payload["b"]) and torch.equal(out["c"], payload["c"])
    assert out["t"] == (1, [2.5, None], "s") and out[7]["nested"][0].shape == (0, 3)
    assert out["raw"] == b"abc" and out["ba"] == b"xy"


def test_views_and_gather_rebuild_the_area_from_read_only_parts():
    """What the Ray connector does: parts go through a store that hands back read-only arrays."""
    enc = codec.encode({"x": torch.arange(10.0), "b": b"hello", "y": torch.ones(3, dtype=torch.int64)})
    parts = [np.frombuffer(v.tobytes(), dtype=np.uint8) for v in enc.views()]  # read-only copies
    area = codec.gather(enc.nbytes, enc.offsets, parts)
    out = codec.decode(enc.header, area)
    assert torch.equal(out["x"], torch.arange(10.0)) and out["b"] == b"hello"
    out["x"] += 1  # writable: the area is private
    with pytest.raises(RefusedPayload):
        codec.gather(enc.nbytes, enc.offsets, parts[:1])
    with pytest.raises(RefusedPayload):
        codec.gather(8, enc.offsets, parts)  # a part beyond the area


class NotAMessage(BaseModel):
    x: int = 1


@pytest.mark.parametrize("payload, where", [
    ({"x": object()}, r"builtins.object \(at payload\['x'\]"),
    ({"a": np.zeros(3)}, "numpy.ndarray"),
    ([{1, 2}], r"builtins.set \(at payload\[0\]"),
    ({"m": NotAMessage()}, "not a Message"),
    ({(1, 2): 3}, "str or int keys"),
    ({"h": torch.empty(2, dtype=torch.bits8)}, "bits8"),
    ({"s": torch.ones(2).to_sparse()}, "sparse"),
    ({"big": 1 << 70, "e": __import__("enum").IntEnum("E", "A").A}, "IntEnum|E"),
])
def test_anything_else_is_refused_at_put_time(payload, where):
    with pytest.raises(UnsupportedPayload, match=where) as info:
        codec.encode(payload)
    assert isinstance(info.value, TypeError) and isinstance(info.value, DataPlaneError)


def test_a_pickle_is_not_a_header_and_is_never_loaded(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = pickle.dumps({"x": Evil()})
    with pytest.raises(RefusedPayload, match="not JSON"):
        codec.decode(bad, memoryview(b""))
    assert not marker.exists()
    pickle.loads(bad)  # the control: these bytes do run code when unpickled
    assert marker.exists()


def test_a_class_name_is_looked_up_never_imported(tmp_path, monkeypatch):
    """A header naming a module that is importable but not imported: refused, and the module stays unloaded."""
    (tmp_path / "canary_module.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                               "from omni_serve.graph.messages import Message\n"
                                               "class Evil(Message):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("canary_module.Evil", "os.system", "builtins.eval", "pydantic.BaseModel", Message.__module__):
        with pytest.raises(RefusedPayload, match="not a message class known"):
            codec.decode(header({"M": name, "F": {}}), memoryview(b""))
    assert "canary_module" not in sys.modules and not (tmp_path / "imported").exists()


T0 = ["float32", [2], 0, False]


@pytest.mark.parametrize("body, match", [
    ({"M": f"{__name__}.Inner", "F": {"t": {"T": T0}, "n": "3"}}, "invalid.*Inner"),  # no lax coercion
    ({"M": f"{__name__}.Inner", "F": {"t": [1.0, 2.0], "n": 3}}, "invalid.*Inner"),  # a list is not a Tensor
    ({"M": f"{__name__}.Inner", "F": {"t": {"T": T0}}}, "invalid.*Inner"),  # missing field
    ({"M": f"{__name__}.Inner", "F": {"t": {"T": T0}, "n": 1, "x": 1}}, "invalid.*Inner"),  # extra field
    ({"M": f"{__name__}.Inner", "F": [["n", 1]]}, "malformed fields"),
    ({"T": ["object", [2], 0, False]}, "unknown tensor dtype"),
    ({"T": ["load", [2], 0, False]}, "unknown tensor dtype"),
    ({"T": ["float32", [1 << 40], 0, False]}, "not an aligned range"),
    ({"T": ["float32", [2], 64, False]}, "not an aligned range"),  # beyond the 64-byte area
    ({"T": ["float32", [2], -64, False]}, "not an aligned range"),
    ({"T": ["float32", [2], 4, False]}, "not an aligned range"),  # misaligned
    ({"T": ["float32", [-2], 0, False]}, "malformed tensor"),
    ({"T": ["float32", [2.0], 0, False]}, "malformed tensor"),
    ({"T": ["int64", [1], 0, True]}, "cannot require grad"),
    ({"T": ["float32", [2], 0]}, "malformed tensor"),
    ({"B": [0, 65]}, "not an aligned range"),
    ({"X": 1}, "unknown node"),
    ({"D": [[[1], 2]]}, "malformed dict item"),
    ({"T": T0, "B": [0, 1]}, "unknown node"),
])
def test_forged_headers_are_refused(body, match):
    area = memoryview(bytearray(64))
    with pytest.raises(RefusedPayload, match=match):
        codec.decode(header(body), area)


@pytest.mark.parametrize("raw, match", [
    (b"", "not JSON"),
    (b"\x80\x05N.", "not JSON"),
    (b'{"v": 2, "p": null}', "not format 1"),
    (b'[1]', "not format 1"),
    (b'{"v": 1, "p": null, "x": 0}', "not format 1"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON|nests too deeply"),
    (b'{"v":1,"p":' + b'{"U":[' * 5000 + b"]}" * 5000 + b"}", "not JSON|nests too deeply"),
])
def test_malformed_headers_are_refused(raw, match):
    with pytest.raises(RefusedPayload, match=match):
        codec.decode(raw, memoryview(b""))
