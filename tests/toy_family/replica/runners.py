"""The toy stages' programs and runners: one step each, on the step engine."""

from __future__ import annotations

from typing import AsyncIterator

from omni_serve.engines.base import StageProgram
from omni_serve.graph.runner import StageRunner
from tests.toy_family.messages import EchoCall, Echoed, Features


class EncodeProgram(StageProgram):
    def __init__(self, model, text: str):
        self.model, self.text, self.done = model, text, False

    def ready(self) -> bool:
        return not self.done

    def step(self) -> list[Features]:
        self.done = True
        return [Features(values=self.model.encode(self.text))]


class DecodeProgram(StageProgram):
    def __init__(self, model):
        self.model, self.features, self.done = model, None, False

    def feed(self, item: Features) -> None:
        self.features = item.values

    def ready(self) -> bool:
        return self.features is not None and not self.done

    def step(self) -> list[Echoed]:
        self.done = True
        return [Echoed(text=self.model.decode(self.features))]

    def release(self) -> None:
        self.features = None


class EncodeRunner(StageRunner):
    async def run(self, engine, call: EchoCall) -> AsyncIterator:
        async for out in self.drive(engine, call.request_id, EncodeProgram(self.model, call.text)):
            yield out


class DecodeRunner(StageRunner):
    async def run(self, engine, call: EchoCall) -> AsyncIterator:
        async for out in self.drive(engine, call.request_id, DecodeProgram(self.model)):
            yield out
