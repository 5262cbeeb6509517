"""Autoregressive engine: continuous batching, paged KV cache with prefix sharing, chunked prefill, KV hand-off.

Only the settings (``ARConfig``, pydantic) load with the package; the engine and sequence classes (torch)
load on first use, so graph specs and ``omni-serve build`` validate configs without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from omni_serve.engines.ar.config import ARConfig

if TYPE_CHECKING:
    from omni_serve.engines.ar.engine import AREngine, ARModel
    from omni_serve.engines.ar.sequence import ARSequence, KVTransfer

__all__ = ["ARConfig", "AREngine", "ARModel", "ARSequence", "KVTransfer"]
_LAZY = {"AREngine": "engine", "ARModel": "engine", "ARSequence": "sequence", "KVTransfer": "sequence"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
