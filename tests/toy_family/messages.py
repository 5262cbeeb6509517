"""What crosses the toy graph's boundaries: ``EchoCall`` (both stages), ``Echoed`` (decode's output) and
``Features`` (encode -> decode: one embedding row per character)."""

from __future__ import annotations

from omni_serve.graph.messages import Message, Tensor


class EchoCall(Message):
    request_id: str
    text: str


class Echoed(Message):
    text: str


class Features(Message):
    values: Tensor
