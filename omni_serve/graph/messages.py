"""Typed messages: what crosses a stage boundary, and nothing else.

Contract: every object that crosses a process boundary on the serving path is a ``Message``:
- a stage *call* (ingress -> stage, over a Serve handle): small metadata, no tensors;
- a stage *output* (stage -> ingress, streamed back over the handle): text, codes, encoded media;
- an edge *payload* (stage -> stage, or ingress -> stage, over the data plane by key): may hold tensors.
A family declares its messages in one module (``families/<family>/messages.py``) and names them in its graph
declaration (``omni_serve.graph.graph``), which checks them where they cross: a stage validates each call
it receives (``Message.model_validate`` re-validates an instance: ``revalidate_instances="always"``),
each payload it reads off the data plane, and the type of every output and payload it produces; fields are
validated when a message is built and when one is assigned (``validate_assignment``).

Tensor fields are typed ``Tensor``: checked as ``torch.Tensor`` at validation time, but declaring them does
not import torch, so specs, graph declarations and the CLI load without it.

Streamed payloads (``EdgeDef.stream``) subclass ``StreamChunk``: their ``end`` field closes the stream.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator, WithJsonSchema

from omni_serve.transport.message_types import register_message_base


class _TensorField:
    """Marker in ``Tensor``'s metadata (lets tools recognise tensor fields)."""


def _check_tensor(value: Any) -> Any:
    import torch  # only where a tensor is validated: that process holds tensors, so torch is loaded

    if not isinstance(value, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(value).__name__}")
    return value


Tensor = Annotated[Any, _TensorField(), PlainValidator(_check_tensor),
                   WithJsonSchema({"type": "object", "description": "torch.Tensor"})]


class Message(BaseModel):
    """Base of every stage call, stage output and edge payload."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, revalidate_instances="always",
                              validate_assignment=True)


register_message_base(Message)  # the data plane carries Messages, rebuilt only as already-imported subclasses


class StreamChunk(Message):
    """One chunk of a streamed edge: the stream ends with the chunk whose ``end`` is true."""

    end: bool = False


def is_tensor_field(annotation_metadata: list[Any]) -> bool:
    """Whether a field's metadata marks it a ``Tensor``."""
    return any(isinstance(m, _TensorField) for m in annotation_metadata)
