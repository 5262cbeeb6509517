"""The engine contract every stage replica hosts, independent of Ray: ``Engine``, and a request's ``StageProgram``.

Contract: a host (the Serve stage deployment, ``LocalGraph``, a benchmark) builds an engine, calls ``start()``
once, runs requests through ``generate(request_id, program, inputs)`` (one async iterator per request, its
outputs as they are produced) and stops one with ``abort(request_id)``. To shut down it calls ``drain(deadline_s)``
(no new requests; those in flight finish, or are aborted at the deadline) and then ``cleanup()`` (idempotent). It
reads ``alive`` (health checks), ``load()`` (autoscaling signals) and ``stats()`` (``/health``), and sets
``on_step`` to observe each batched computation (metrics). A *program* is the engine's form of one request's
work: a ``StageProgram`` (a state machine the engine steps) for the native engines, a ``VllmRequest`` (prompt and
sampling parameters) for vLLM; the engine decides when work runs, so batching policy lives in one place.

Admission (at most ``max_active`` requests at once, more wait), the load formula and ``drain`` are implemented
once, in ``omni_serve.engines.admission.AdmittingEngine``; engines of a kind are built through
``omni_serve.engines.registry``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable


class StageProgram(abc.ABC):
    """One request's work on one stage.

    The engine calls ``feed``/``close_input`` with upstream payloads (in order), ``ready()`` to ask whether
    ``step()`` can make progress now, and ``step()`` to advance by one unit (a forward pass) and return the
    outputs produced. ``done`` ends the request; ``release()`` frees its memory (KV cache, buffers).
    """

    done: bool = False

    def feed(self, item: Any) -> None:  # noqa: B027 - optional for programs without inputs
        raise RuntimeError(f"{type(self).__name__} takes no streamed input")

    def close_input(self) -> None:  # noqa: B027
        pass

    @abc.abstractmethod
    def ready(self) -> bool: ...

    @abc.abstractmethod
    def step(self) -> list[Any]: ...

    def release(self) -> None:  # noqa: B027
        pass

    def work_left(self) -> float | None:
        """Units of work this request still needs (e.g. denoising steps), for load reporting; None: unknown."""
        return None


@dataclass(frozen=True)
class DrainReport:
    """What ``Engine.drain`` did: requests that finished in time, were aborted at the deadline, or were refused
    (waiting for admission when the drain began)."""

    finished: int = 0
    aborted: int = 0
    refused: int = 0


class Engine(abc.ABC):
    """The whole host-facing contract of a stage's engine (see the module docstring)."""

    on_step: Callable[[int, float], None] | None = None
    """Called after each batched computation with the number of requests in it and its seconds (from the engine's
    worker thread or vLLM's output loop; it must be cheap and thread-safe). Set by the replica's metrics
    (``omni_serve.metrics.StageMetrics``); None: nobody observes."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Start the engine (worker thread, or vLLM's processes). Idempotent; ``generate`` calls it when a host
        did not. Raises what keeps the engine from starting (a host fails its deployment with it)."""

    @abc.abstractmethod
    def generate(self, request_id: str, program: Any, inputs: AsyncIterator[Any] | None = None) -> AsyncIterator[Any]:
        """Run one request; an async generator of its outputs as they are produced.

        Args:
            request_id: unique among the requests in flight on this engine (``ValueError`` if one is running).
            program: the request's work in this engine's form (``StageProgram`` for the native engines,
                ``VllmRequest`` for vLLM).
            inputs: upstream payloads fed to the program in order as they arrive (``StageProgram.feed``), None
                when the program has everything it needs; an engine that takes no streamed input refuses it.

        Returns:
            The outputs of the request, in order; the iterator ends when the request is done. It raises the
            request's own failure; ``omni_serve.api.errors.Draining`` when the engine is draining (refused before
            any work, or aborted at the drain's deadline); an error after ``abort``. Closing or cancelling the
            iterator aborts the request. Requests beyond ``max_active`` wait here for admission.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds (KV blocks, buffers) at once; its ``generate`` iterator ends with
        an error. Unknown or finished ids are ignored."""

    @abc.abstractmethod
    async def drain(self, deadline_s: float) -> DrainReport:
        """Prepare for shutdown: admit nothing more, let the requests in flight finish.

        Args:
            deadline_s: seconds to wait for the requests in flight; those still running then are aborted.

        Returns:
            How many requests finished in time, were aborted, were refused while waiting for admission. From
            the call on, every new ``generate`` raises ``Draining``. The engine keeps running (``cleanup`` stops
            it).
        """

    @abc.abstractmethod
    async def cleanup(self) -> None:
        """Abort every request and stop the engine, freeing its threads, processes and memory. Idempotent; after
        it, ``generate`` fails."""

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """False once the engine can no longer serve (its worker died, vLLM's engine errored): the host reports
        the replica unhealthy. True before ``start``."""

    def stalled_s(self) -> float:
        """Seconds the step the engine is running now has taken (0 between steps, and for engines that do not
        step in this process): past the stage's ``max_step_s`` the host reports the replica unhealthy."""
        return 0.0

    @abc.abstractmethod
    def load(self) -> dict[str, float]:
        """This replica's autoscaling signals, all numbers: at least ``load`` (demand as a fraction of what the
        replica serves; > 1: saturated, work waiting), ``utilization``, ``backlog``, ``queued`` and ``active``
        (see ``omni_serve.engines.admission``), plus engine-specific ones (KV use, batch occupancy, ...)."""

    def cpu_use(self) -> dict[str, float] | None:
        """The replica process' CPU use (``omni_serve.engines.load.CpuUse``): ``per_s``, CPU seconds per second;
        ``engine_per_s``, of it the steps' own (the worker thread's); ``fixed_per_s``, of those the part fixed per
        step; None when unknown (an engine that computes in other processes, like vLLM's). Admission by real-time
        capacity projects it to more streams."""
        return None

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and state for ``/health`` and metrics (JSON-serializable): at least ``active``."""
