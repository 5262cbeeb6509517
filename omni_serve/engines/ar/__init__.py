"""Autoregressive engine: continuous batching, paged KV cache with prefix sharing, chunked prefill, KV hand-off."""

from omni_serve.engines.ar.config import ARConfig
from omni_serve.engines.ar.engine import AREngine, ARModel
from omni_serve.engines.ar.sequence import ARSequence, KVTransfer

__all__ = ["ARConfig", "AREngine", "ARModel", "ARSequence", "KVTransfer"]
