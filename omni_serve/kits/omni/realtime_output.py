"""A realtime response's output events, written as the graph's text and audio arrive (``kits.omni.realtime``).

Contract: ``ResponseWriter(session, response)`` is told the prepared chat request (``start(prepared)``), then fed the
text stage's ``TextDelta``s (``text``) and code2wav's ``AudioDelta``s (``audio``) in arrival order, and finally
``close(status)``. It sends, in OpenAI's GA order: for the assistant message (opened at its first text or audio)
``response.output_item.added``, ``conversation.item.added`` and ``response.content_part.added`` (part ``audio`` with
a transcript, or ``text``), then ``response.output_audio.delta`` / ``response.output_audio_transcript.delta`` (or
``response.output_text.delta``) as they come, and at the close ``response.output_audio.done`` and
``response.output_audio_transcript.done`` (or ``response.output_text.done``), ``response.content_part.done``,
``response.output_item.done`` and ``conversation.item.done``. With tools, the text goes through
``api.tools.ToolCallStream``: each call becomes a ``function_call`` item of its own (``output_item.added``,
``function_call_arguments.delta`` with the whole arguments, ``function_call_arguments.done``,
``output_item.done``), after the message is closed. Every item it writes joins the session's conversation.
``view(status, ...)`` is the ``response`` object of ``response.created`` / ``response.done`` (with the usage once
done). A cancelled response closes its message as ``incomplete``, holding what was sent.
"""

from __future__ import annotations

import base64

import numpy as np

from omni_serve.api import realtime_protocol as R
from omni_serve.api.speech_audio import to_pcm16
from omni_serve.api.tools import ToolCall, ToolCallStream


class ResponseWriter:
    def __init__(self, session, response, modalities: list[str]):
        self.s, self.r = session, response
        self.planned = modalities  # what response.created shows, before the request is prepared
        self.p = None
        self.calls: ToolCallStream | None = None
        self.message = None  # the assistant message Item while it is open
        self.output: list = []  # the response's items, in order
        self.tokens = 0
        self.finish: str | None = None

    def start(self, prepared) -> None:
        self.p = prepared
        self.calls = ToolCallStream() if prepared.tool_calls else None

    @property
    def _audio_out(self) -> bool:
        return self.p is not None and self.p.voice is not None

    def _ids(self, item) -> dict:
        return {"response_id": self.r.id, "item_id": item.id, "output_index": self.output.index(item)}

    async def text(self, out) -> None:
        self.tokens += len(out.token_ids)
        self.finish = out.finish_reason or self.finish
        if out.text:
            for piece in self.calls.feed(out.text) if self.calls is not None else [out.text]:
                await (self._content(piece) if isinstance(piece, str) else self._call(piece))

    async def audio(self, out) -> None:
        pcm = to_pcm16(np.frombuffer(out.samples, dtype="<f4")).tobytes()
        self.p.clock.audio(len(pcm) / (R.PCM_RATE * 2))  # real-time admission and the route's playback metrics
        item = await self._open_message()
        item.audio_ms += len(pcm) / (R.PCM_RATE * 2 / 1000)
        await self.s.send(R.server_event("response.output_audio.delta", **self._ids(item), content_index=0,
                                         delta=base64.b64encode(pcm).decode()))

    async def _open_message(self):
        from omni_serve.kits.omni.realtime import Item

        if self.message is not None:
            return self.message
        part = {"type": "output_audio", "transcript": ""} if self._audio_out else {"type": "output_text", "text": ""}
        item = self.message = Item(R.new_id("item"), "message", role="assistant", parts=[part],
                                   response_id=self.r.id, status="in_progress")
        await self._add(item)
        await self.s.send(R.server_event("response.content_part.added", **self._ids(item), content_index=0,
                                         part={"type": "audio", "transcript": ""} if self._audio_out
                                         else {"type": "text", "text": ""}))
        return item

    async def _add(self, item, **shown) -> None:
        """``item`` joins the response and the conversation (``shown``: fields the added events show instead)."""
        previous = self.s.items[-1].id if self.s.items else None
        self.s.items.append(item)
        self.output.append(item)
        view = {**item.view(), **shown}
        await self.s.send(R.server_event("response.output_item.added", response_id=self.r.id,
                                         output_index=len(self.output) - 1, item=view))
        await self.s.send(R.server_event("conversation.item.added", previous_item_id=previous, item=view))

    async def _content(self, text: str) -> None:
        self.p.clock.text()
        item = await self._open_message()
        part = item.parts[0]
        if self._audio_out:
            part["transcript"] += text
            await self.s.send(R.server_event("response.output_audio_transcript.delta", **self._ids(item),
                                             content_index=0, delta=text))
        else:
            part["text"] += text
            await self.s.send(R.server_event("response.output_text.delta", **self._ids(item), content_index=0,
                                             delta=text))

    async def _call(self, call: ToolCall) -> None:
        from omni_serve.kits.omni.realtime import Item

        await self._close_message("completed")
        # the call is whole already: the conversation holds it complete even if a cancel cuts the events below
        item = Item(R.new_id("item"), "function_call", call_id=call.id, name=call.function.name,
                    arguments=call.function.arguments, response_id=self.r.id)
        await self._add(item, arguments="", status="in_progress")
        ids = {**self._ids(item), "call_id": call.id}
        await self.s.send(R.server_event("response.function_call_arguments.delta", **ids,
                                         delta=call.function.arguments))
        await self.s.send(R.server_event("response.function_call_arguments.done", **ids, name=call.function.name,
                                         arguments=call.function.arguments))
        await self._item_done(item)

    async def _item_done(self, item) -> None:
        await self.s.send(R.server_event("response.output_item.done", response_id=self.r.id,
                                         output_index=self.output.index(item), item=item.view()))
        await self.s.send(R.server_event("conversation.item.done", item=item.view()))

    async def _close_message(self, status: str) -> None:
        item, self.message = self.message, None
        if item is None:
            return
        part, ids = item.parts[0], self._ids(item)
        if self._audio_out:
            await self.s.send(R.server_event("response.output_audio.done", **ids, content_index=0))
            await self.s.send(R.server_event("response.output_audio_transcript.done", **ids, content_index=0,
                                             transcript=part["transcript"]))
            done = {"type": "audio", "transcript": part["transcript"]}
        else:
            await self.s.send(R.server_event("response.output_text.done", **ids, content_index=0, text=part["text"]))
            done = {"type": "text", "text": part["text"]}
        await self.s.send(R.server_event("response.content_part.done", **ids, content_index=0, part=done))
        item.status = "completed" if status == "completed" else "incomplete"
        await self._item_done(item)

    async def close(self, status: str) -> None:
        if self.calls is not None and status in ("completed", "incomplete"):
            for piece in self.calls.finish():
                await (self._content(piece) if isinstance(piece, str) else self._call(piece))
        await self._close_message(status)

    def view(self, status: str, reason: str | None = None, error=None) -> dict:
        out = {"id": self.r.id, "object": "realtime.response", "status": status,
               "output": [item.view() for item in self.output], "metadata": self.r.params.metadata,
               "output_modalities": self.planned if self.p is None else ["audio"] if self._audio_out else ["text"],
               "conversation_id": self.s.id}
        if self._audio_out:
            out["audio"] = {"output": {"format": R.PCM_FORMAT, "voice": self.p.voice}}
        if status == "in_progress":
            return out
        details: dict = {"type": status}
        if status == "cancelled":
            details["reason"] = reason or "client_cancelled"
        elif status == "incomplete":
            details["reason"] = "max_output_tokens"
        elif status == "failed" and error is not None:
            details["error"] = {"type": error.type, "code": error.code, "message": error.message}
        prompt = self.p.prompt_len if self.p is not None else 0
        out.update(status_details=details, usage={"total_tokens": prompt + self.tokens, "input_tokens": prompt,
                                                  "output_tokens": self.tokens})
        return out
