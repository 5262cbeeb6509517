"""Which pydantic class the data plane carries as typed messages (torch-free, so declarations can import it).

Contract: the graph layer (``omni_serve.graph.messages``) registers its ``Message`` base with
``register_message_base`` when it is defined; the codec (``omni_serve.transport.codec``) asks
``message_base()`` and rebuilds payloads only as subclasses of it that are already imported. Until a base is
registered, the data plane carries no messages (a process that never imported one has none to receive).
Registration lets the transport layer know the class without importing the layer above it. ``Payload`` is
what connectors are typed on: that base (a pydantic model; transport cannot name ``Message`` itself).
"""

from __future__ import annotations

from typing import TypeAlias

from pydantic import BaseModel

Payload: TypeAlias = BaseModel  # a ``Message`` (omni_serve.graph.messages), the registered base's subclass

_BASE: type[BaseModel] | None = None


def register_message_base(cls: type[BaseModel]) -> type[BaseModel]:
    global _BASE
    if _BASE is not None and _BASE is not cls:
        raise ValueError(f"the data plane's message base is already {_BASE.__qualname__}")
    _BASE = cls
    return cls


def message_base() -> type[BaseModel] | None:
    return _BASE
