"""Ingress side of the toy graph: ``POST /v1/toy/echo`` -> both stage calls at once -> the echoed text."""

from __future__ import annotations

from pydantic import BaseModel, Field

from omni_serve.api.errors import bad_request
from omni_serve.graph.frontend import Frontend, RequestContext, Route
from omni_serve.request_ids import new_request_id
from tests.toy_family.messages import EchoCall, Echoed


class EchoRequest(BaseModel):
    text: str = Field(description="What to echo (printable ASCII).")


class EchoResponse(BaseModel):
    text: str


class ToyFrontend(Frontend):
    routes = (Route("/v1/toy/echo", "echo", "echo", EchoRequest, summary="Echo a text through two stages."),)

    async def echo(self, body: EchoRequest, ctx: RequestContext) -> EchoResponse:
        if not body.text or len(body.text) > self.spec.max_chars or not body.text.isascii():
            raise bad_request(f"text must be 1 to {self.spec.max_chars} ASCII characters.", param="text")
        rid = new_request_id("toy")
        call = EchoCall(request_id=rid, text=body.text)
        out = [o async for _, o in self.stages.stream(rid, {"encode": call, "decode": call}, ctx.timeout_s)]
        (echoed,) = [o for o in out if isinstance(o, Echoed)]
        return EchoResponse(text=echoed.text)
