"""The engine lifecycle every stage replica hosts, independent of Ray.

Contract: ``start()`` once before use; ``generate(request_id, program, inputs)`` runs one request and yields
its outputs as they are produced; ``abort(request_id)`` stops a request and frees what it holds at once;
``cleanup()`` stops everything and is idempotent. A *program* is one request's state machine (see
``StageProgram``); the engine decides when programs step, so batching policy lives in one place.
"""

from __future__ import annotations

import abc
from typing import Any, AsyncIterator


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


class Engine(abc.ABC):
    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    def generate(self, request_id: str, program: StageProgram,
                 inputs: AsyncIterator[Any] | None = None) -> AsyncIterator[Any]: ...

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def cleanup(self) -> None: ...

    def load(self) -> dict[str, float]:
        """Autoscaling signals of this replica (numbers only); see ``omni_serve.engines.loop.LoopEngine``."""
        return {}
