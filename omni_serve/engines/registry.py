"""Which engine a stage runs: a registry of engine kinds, each a factory named as ``module:function``.

Contract: ``make_engine(kind, site)`` builds the engine of ``kind`` for a stage: it imports the kind's factory
(only then: a replica imports the engines it runs, and vLLM's only where a stage runs on vLLM) and returns
``factory(site)``. ``site`` is what a factory reads of the stage (``EngineSite``; a
``omni_serve.graph.runner.StageRunner`` is one). ``register_engine(kind, "module:function")`` adds or replaces a
kind in this process; ``known_engines()`` lists them. An unknown kind is a ``ValueError`` that names the known
ones.

Built in: ``ar`` (``AREngine``: continuous batching over a paged KV cache), ``batch`` (``BatchEngine``), ``step``
(``StepEngine``), the ``EngineKind`` values a stage declares, and ``vllm`` (``VllmEngine``, for stages whose
``engine.backend`` is vllm).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol

from omni_serve.engines.base import Engine


class EngineSite(Protocol):
    """What engine factories read of the stage they build an engine for."""

    stage: Any  # the stage's declaration: its ``name`` names the engine (logs, metrics, worker thread)
    spec: Any  # the graph's spec: ``checkpoint`` (engines that load weights themselves, vLLM)
    engine_spec: Any  # the stage's ``EngineSpec``: max_active_requests, torch_threads, dtype, device, ar, vllm
    model: Any  # the stage's model adapter, loaded
    work_unit: str | None  # batch stages: what programs' ``work_left()`` counts (load reporting)

    def batch_compute(self) -> Callable[[list[Any]], list[Any]]:
        """Batch stages: the engine's ``compute(payloads) -> results``."""

    def max_batch(self) -> int:
        """Batch stages: payloads per compute call."""

    def engine_options(self) -> dict[str, Any]:
        """Further keyword arguments of the engine's constructor (kind-specific)."""


_ENGINES: dict[str, str] = {
    "ar": "omni_serve.engines.ar.engine:build_engine",
    "batch": "omni_serve.engines.batch:build_engine",
    "step": "omni_serve.engines.stepper:build_engine",
    "vllm": "omni_serve.engines.vllm_engine.engine:build_engine",
}


def register_engine(kind: str, path: str) -> None:
    """Register ``kind`` as ``module:function`` (a factory ``(EngineSite) -> Engine``), imported when first used."""
    _ENGINES[kind] = path


def known_engines() -> list[str]:
    return sorted(_ENGINES)


def engine_factory(kind: str) -> Callable[[EngineSite], Engine]:
    """The factory registered for ``kind`` (imports its module)."""
    if kind not in _ENGINES:
        raise ValueError(f"unknown engine kind {kind!r}; known: {', '.join(known_engines())}")
    module, _, name = _ENGINES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def make_engine(kind: str, site: EngineSite) -> Engine:
    return engine_factory(kind)(site)
