"""The WebSocket side every realtime session shares (OpenAI's Realtime API): the receive loop, ordered sends, and
errors that never end the connection.

Contract: a session subclasses ``RealtimeConnection(websocket, ctx, label)`` (``ctx``: the session's
``omni_serve.graph.frontend.RequestContext``) and implements ``handle(event)`` (a
validated client event, ``realtime_protocol.parse_client_event``); it may override ``refusal()`` (a
``RealtimeProblem`` for a connection it does not serve, e.g. an unknown ``model`` query parameter: sent as an
``error`` event, then the socket is closed with code 1008), ``opened()`` (before the first event is read: send
``session.created``) and ``closed()`` (once the client left, or the loop failed: cancel what the session runs).
``run()`` drives it: a problem a handler raises (``RealtimeProblem``) becomes an ``error`` event and any other
exception an ``internal_error`` one (logged); either way the connection stays open. ``send(event)`` sends events in
order, and an event handed to it goes out even if its caller is cancelled while waiting its turn.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from omni_serve.api import realtime_protocol as R

log = logging.getLogger(__name__)
MAX_EVENT_BYTES = 16 << 20  # one client event (an append of minutes of audio fits)


class RealtimeConnection:
    def __init__(self, websocket, ctx: Any, label: str = "realtime session"):
        self.ws, self.ctx, self.label = websocket, ctx, label
        self.id = R.new_id("sess")
        self._send_lock = asyncio.Lock()

    # -- what a session provides ----------------------------------------------------------------------------
    model_name: str | None = None  # the served model: a handshake naming another (``?model=``) is refused

    def refusal(self) -> R.RealtimeProblem | None:
        """Why this connection is not served (None: it is); by default, a ``model`` query parameter naming another
        model than ``model_name``."""
        model = self.ws.query_params.get("model")
        if self.model_name is not None and model not in (None, "", self.model_name):
            return R.RealtimeProblem(f"The model {model!r} does not exist; this server serves {self.model_name!r}.",
                                     code="model_not_found", param="model")
        return None

    async def opened(self) -> None:
        """Called once before the first client event is read."""

    async def handle(self, event) -> None:
        raise NotImplementedError

    async def closed(self) -> None:
        """Called once when the session ends."""

    # -- the loop -------------------------------------------------------------------------------------------
    async def run(self) -> None:
        problem = self.refusal()
        if problem is not None:
            await self.send(problem.event())
            await self.ws.close(code=1008, reason=problem.code)
            return
        await self.opened()
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    break
                data = message.get("text") if message.get("text") is not None else message.get("bytes")
                try:
                    if data is None or len(data) > MAX_EVENT_BYTES:
                        raise R.RealtimeProblem(f"An event must be a text message of at most {MAX_EVENT_BYTES} "
                                                "bytes.", code="invalid_event")
                    await self.handle(R.parse_client_event(data))
                except R.RealtimeProblem as problem:
                    await self.send(problem.event())
                except Exception as exc:  # noqa: BLE001 - one event's failure must not end the session
                    log.error("%s %s: an event failed", self.label, self.id, exc_info=exc)
                    await self.send(R.RealtimeProblem(f"Internal server error (session {self.id}); the details are "
                                                      "in the server log.", code="internal_error",
                                                      type="server_error").event())
        finally:
            await self.closed()

    async def send(self, event: dict) -> None:
        """Send ``event``, in order (see the module doc)."""
        await asyncio.shield(self._send(event))

    async def _send(self, event: dict) -> None:
        async with self._send_lock:
            try:
                await self.ws.send_json(event)
            except Exception:  # noqa: BLE001 - the client left; the receive loop ends the session
                pass
