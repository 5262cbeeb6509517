"""OpenAI's Realtime API (``/v1/realtime``, WebSocket) on the Qwen-Omni graphs: a spoken conversation whose turns run
through the graph's own chat path.

Contract: ``RealtimeEndpoints`` is mixed into ``OmniFrontend``; ``realtime_session(websocket, ctx)`` runs one
``RealtimeSession`` on an accepted connection until the client leaves. The session keeps:

* its settings (``api.realtime_protocol.SessionSettings``: ``session.update`` changes what it names);
* the conversation: items in order (user, system and assistant messages, function calls and their outputs; user
  audio kept as the pcm16 the client sent);
* the input audio buffer (pcm16, 24 kHz), committed by the client (``input_audio_buffer.commit``) or, with
  ``server_vad``, by the server when Silero VAD hears the speech stop (``api.vad``): the committed segment starts
  ``prefix_padding_ms`` before the detected start;
* at most one response at a time. A response renders the conversation as a chat request (the session's
  instructions or the graph's system prompt, user audio as ``input_audio`` parts, assistant turns as their text —
  a truncated one as the part its listener heard —, calls and outputs as ``tool_calls`` and ``tool`` messages) and
  runs it as ``/v1/chat/completions`` would (``OmniFrontend.prepare``, real-time admission, the stage calls), so
  its text and audio equal a chat reply to the same history. Its events are OpenAI's GA events in their order:
  ``response.created``, ``response.output_item.added`` / ``conversation.item.added``,
  ``response.content_part.added``, the audio, transcript or text deltas, a forced call's
  ``response.function_call_arguments.delta/done``, the ``.done`` events, and ``response.done`` with the status
  (``completed``, ``incomplete`` at the token limit, ``cancelled``, ``failed``) and the usage.

``response.cancel``, or speech detected while a response runs (``interrupt_response``: barge-in), cancels it: its
stage calls are cancelled at once (every stage frees the request; on barge-in the moment VAD hears the speech, before
``input_audio_buffer.speech_started`` is sent, so a client slow to read its events does not delay it), and
``response.done`` says ``cancelled`` with the reason (``client_cancelled``, ``turn_detected``). A history longer than the context is cut from its oldest items
for the prompt (OpenAI's ``truncation: auto``). Tools follow chat's rules: a forced call (``required`` or named)
makes a text-only response; ``auto`` with audio output is refused (the talker would speak the call). A bad client
event gets an ``error`` event naming it, and the connection stays open.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from omni_serve.api import protocol as P
from omni_serve.api import realtime_protocol as R
from omni_serve.api.realtime_connection import RealtimeConnection
from omni_serve.api.realtime_input import BYTES_PER_MS, InputAudioBuffer, pcm16
from omni_serve.api.errors import OpenAIError
from omni_serve.api.tools import arguments_object
from omni_serve.graph.frontend import RequestContext, WebSocketRoute
from omni_serve.kits.omni.messages import AudioDelta, TextDelta
from omni_serve.metrics import RequestClock

log = logging.getLogger(__name__)


@dataclass
class Item:
    """A conversation item as the session keeps it (``view()``: as the events show it, without audio data)."""

    id: str
    type: str  # message | function_call | function_call_output
    role: str | None = None
    parts: list[dict] = field(default_factory=list)  # input_text {text} / input_audio {audio: bytes} / output_*
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    response_id: str | None = None  # the response that wrote it
    status: str = "completed"
    audio_ms: float = 0.0  # assistant audio sent to the client
    heard_ms: float | None = None  # conversation.item.truncate: what the listener heard

    def view(self) -> dict:
        out: dict[str, Any] = {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status}
        if self.type == "message":
            out["role"] = self.role
            out["content"] = [{k: v for k, v in p.items() if k != "audio"} for p in self.parts]
        elif self.type == "function_call":
            out.update(call_id=self.call_id, name=self.name, arguments=self.arguments)
        else:
            out.update(call_id=self.call_id, output=self.output)
        return out

    def text(self) -> str:
        """An assistant message's text as the model sees it again: a truncated spoken reply keeps the share of its
        transcript that was heard (by characters, cut at a word)."""
        part = self.parts[0] if self.parts else {}
        text = part.get("transcript") or part.get("text") or ""
        if self.heard_ms is not None and self.audio_ms > 0:
            keep = int(len(text) * min(1.0, self.heard_ms / self.audio_ms))
            text = text[:keep].rsplit(" ", 1)[0] if keep < len(text) else text
        return text


@dataclass
class Response:
    id: str
    params: R.ResponseParams
    task: asyncio.Task | None = None
    cancel_reason: str | None = None
    closing: bool = False  # its final events are being sent: a cancel no longer interrupts them
    finished: bool = False  # response.done was sent


class RealtimeEndpoints:
    """``/v1/realtime`` of a Qwen-Omni frontend (see the module doc). Uses the frontend's ``spec``, ``voices``,
    ``prepare``, ``admit_stream``, ``_voice`` and ``_events``."""

    websocket_routes = (WebSocketRoute("/v1/realtime", "realtime", "realtime_session"),)

    async def realtime_session(self, websocket, ctx: RequestContext) -> None:
        await RealtimeSession(self, websocket, ctx).run()


class RealtimeSession(RealtimeConnection):
    def __init__(self, frontend, websocket, ctx: RequestContext):
        super().__init__(websocket, ctx)
        self.f = frontend
        self.model_name = frontend.spec.model_name
        self.settings = R.SessionSettings()
        self.items: list[Item] = []
        self.response: Response | None = None
        self.asked_since: float | None = None  # when an answer refused at the real-time capacity was first asked for
        self.max_buffer_ms = frontend.spec.max_audio_seconds * 1000
        self.input = InputAudioBuffer(self.max_buffer_ms, self._speech_started, self._speech_stopped)

    # -- the connection -------------------------------------------------------------------------------------
    async def opened(self) -> None:
        await self.input.configure(self.settings.audio.input.turn_detection)
        await self.send(R.server_event("session.created", session=self._session_view()))

    async def closed(self) -> None:
        if self.response is not None and self.response.task is not None:
            self.response.cancel_reason = "client_cancelled"
            self.response.task.cancel()
            await asyncio.gather(self.response.task, return_exceptions=True)

    # -- client events --------------------------------------------------------------------------------------
    async def handle(self, e) -> None:
        handler = getattr(self, "_on_" + e.type.replace(".", "_"))
        await handler(e)

    async def _on_session_update(self, e: R.SessionUpdate) -> None:
        changes = e.session
        if changes.get("type", "realtime") != "realtime":
            raise R.RealtimeProblem("Only realtime sessions are served (not transcription).", param="session.type",
                                    event_id=e.event_id)
        try:
            settings = self.settings.updated(changes)
        except ValidationError as exc:
            raise R.problem_of(exc, e.event_id, "session.") from None
        self._check_voice(settings.audio.output.voice, "session.audio.output.voice", e.event_id)
        if settings.tools and settings.tool_choice == "auto" and "audio" in settings.output_modalities:
            raise R.RealtimeProblem("Tools with tool_choice 'auto' are served with output_modalities ['text'] (the "
                                    "talker would speak a call); a forced tool_choice makes text-only responses.",
                                    param="session.tools", event_id=e.event_id)
        vad_before = self.settings.audio.input.turn_detection
        self.settings = settings
        if settings.audio.input.turn_detection != vad_before:
            await self.input.configure(settings.audio.input.turn_detection)
        await self.send(R.server_event("session.updated", session=self._session_view()))

    async def _on_input_audio_buffer_append(self, e: R.AudioAppend) -> None:
        await self.input.append(pcm16(e.audio, "audio", e.event_id), e.event_id)

    async def _on_input_audio_buffer_commit(self, e: R.AudioCommit) -> None:
        await self._commit(*self.input.commit(e.event_id))

    async def _on_input_audio_buffer_clear(self, e: R.AudioClear) -> None:
        self.input.clear()
        await self.send(R.server_event("input_audio_buffer.cleared"))

    async def _on_conversation_item_create(self, e: R.ItemCreate) -> None:
        item = self._item_of(e.item, e.event_id)
        if any(i.id == item.id for i in self.items):
            raise R.RealtimeProblem(f"An item with id {item.id!r} exists.", param="item.id", event_id=e.event_id)
        previous = self._insert(item, e.previous_item_id, e.event_id)
        await self.send(R.server_event("conversation.item.added", previous_item_id=previous, item=item.view()))
        await self.send(R.server_event("conversation.item.done", previous_item_id=previous, item=item.view()))
        await self._bound_audio()

    async def _on_conversation_item_retrieve(self, e: R.ItemRetrieve) -> None:
        item = self._find(e.item_id, e.event_id)
        view = item.view()
        for part, shown in zip(item.parts, view.get("content", [])):
            if part.get("audio") is not None:
                shown["audio"] = base64.b64encode(part["audio"]).decode()
        await self.send(R.server_event("conversation.item.retrieved", item=view))

    async def _on_conversation_item_truncate(self, e: R.ItemTruncate) -> None:
        item = self._find(e.item_id, e.event_id)
        if item.type != "message" or item.role != "assistant" or not item.parts \
                or item.parts[0].get("type") != "output_audio":
            raise R.RealtimeProblem("Only an assistant audio message can be truncated.", param="item_id",
                                    event_id=e.event_id)
        if e.content_index != 0:
            raise R.RealtimeProblem("content_index must be 0 (the message's audio).", param="content_index",
                                    event_id=e.event_id)
        if e.audio_end_ms > math.ceil(item.audio_ms):
            raise R.RealtimeProblem(f"audio_end_ms {e.audio_end_ms} is past the item's {item.audio_ms:.0f} ms of "
                                    "audio.", param="audio_end_ms", event_id=e.event_id)
        item.heard_ms = float(e.audio_end_ms)
        await self.send(R.server_event("conversation.item.truncated", item_id=item.id, content_index=0,
                                       audio_end_ms=e.audio_end_ms))

    async def _on_conversation_item_delete(self, e: R.ItemDelete) -> None:
        item = self._find(e.item_id, e.event_id)
        self.items.remove(item)
        await self.send(R.server_event("conversation.item.deleted", item_id=item.id))

    async def _on_response_create(self, e: R.ResponseCreate) -> None:
        if self.response is not None:
            raise R.RealtimeProblem(f"The conversation already has an active response ({self.response.id}); "
                                    "cancel it or wait for response.done.",
                                    code="conversation_already_has_active_response", event_id=e.event_id)
        if not any(i.type == "function_call_output" or i.role == "user" for i in self.items):
            raise R.RealtimeProblem("The conversation has nothing to answer yet (no user or tool item).",
                                    code="conversation_empty", event_id=e.event_id)
        if e.response.input is not None:
            raise R.RealtimeProblem("A response's own input is not served; it answers the conversation.",
                                    param="response.input", event_id=e.event_id)
        if e.response.conversation == "none":
            raise R.RealtimeProblem("Out-of-band responses (conversation 'none') are not served.",
                                    param="response.conversation", event_id=e.event_id)
        self._start_response(e.response)

    async def _on_response_cancel(self, e: R.ResponseCancel) -> None:
        if self.response is None or (e.response_id and e.response_id != self.response.id):
            raise R.RealtimeProblem("There is no active response to cancel.", code="response_cancel_not_active",
                                    event_id=e.event_id)
        await self._cancel("client_cancelled")

    # -- turns ----------------------------------------------------------------------------------------------
    async def _speech_started(self, item_id: str, ms: int) -> None:
        barge_in = self.response is not None and self.settings.audio.input.turn_detection.interrupt_response
        if barge_in:  # the reply stops now, not once the client has read the event (a slow reader pushes back)
            self._stop("turn_detected")
        await self.send(R.server_event("input_audio_buffer.speech_started", audio_start_ms=ms, item_id=item_id))
        if barge_in:
            await self._cancel("turn_detected")

    async def _speech_stopped(self, item_id: str, ms: int, audio: bytes) -> None:
        await self.send(R.server_event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id))
        await self._commit(item_id, audio)
        if self.settings.audio.input.turn_detection.create_response and self.response is None:
            self._start_response(R.ResponseParams())

    async def _commit(self, item_id: str, audio: bytes) -> None:
        """``audio`` (a committed turn) becomes a user audio message."""
        item = Item(item_id, "message", role="user", parts=[{"type": "input_audio", "transcript": None,
                                                              "audio": audio}])
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        await self.send(R.server_event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id))
        await self.send(R.server_event("conversation.item.added", previous_item_id=previous, item=item.view()))
        await self.send(R.server_event("conversation.item.done", previous_item_id=previous, item=item.view()))
        await self._bound_audio()

    async def _bound_audio(self) -> None:
        """Keep the audio items a prompt can hold (``limits.max_media_parts``): older ones are deleted (the client is
        told), so a session's memory stays bounded."""
        while sum(map(_audio_parts, self.items)) > self.f.spec.limits.max_media_parts:
            oldest = next(i for i in self.items if _audio_parts(i))
            self.items.remove(oldest)
            await self.send(R.server_event("conversation.item.deleted", item_id=oldest.id))

    # -- responses ------------------------------------------------------------------------------------------
    def _start_response(self, params: R.ResponseParams) -> None:
        self.response = Response(R.new_id("resp"), params)
        self.response.task = asyncio.create_task(self._respond(self.response))

    def _stop(self, reason: str) -> None:
        """Cancel the active response's task now, once (a second cancel would cut the final events it sends), unless
        those final events are already being sent."""
        r = self.response
        if r is not None and r.task is not None and not r.closing and r.cancel_reason is None:
            r.cancel_reason = reason
            r.task.cancel()

    async def _cancel(self, reason: str) -> None:
        r = self.response
        if r is None or r.task is None:
            return
        self._stop(reason)
        await asyncio.gather(r.task, return_exceptions=True)
        if not r.finished:  # cancelled before its first step: it sent nothing yet
            from omni_serve.kits.omni.realtime_output import ResponseWriter

            writer = ResponseWriter(self, r, r.params.output_modalities or self.settings.output_modalities)
            await self.send(R.server_event("response.created", response=writer.view("in_progress")))
            await self.send(R.server_event("response.done", response=writer.view("cancelled", reason)))
            r.finished = True
            if self.ctx.record is not None:
                self.ctx.record(None, "cancelled")
        if self.response is r:
            self.response = None

    async def _respond(self, r: Response) -> None:
        from omni_serve.kits.omni.realtime_output import ResponseWriter

        modalities = r.params.output_modalities or self.settings.output_modalities
        writer = ResponseWriter(self, r, ["audio"] if "audio" in modalities else ["text"])
        ctx = RequestContext(self.ctx.timeout_s)
        clock = RequestClock(buffer_s=self.f.spec.playback.client_buffer_s)  # from the response's start
        status, error = "completed", None
        try:
            await self.send(R.server_event("response.created", response=writer.view("in_progress")))
            # admitted before its prompt is prepared: a refused answer costs nothing
            ticket = await self._admit(r, ctx, clock) if "audio" in writer.planned else None
            p = await self._prepared(r)
            if ticket is not None and p.voice is None:  # it does not speak after all (a forced tool call)
                ticket.release()
            p.clock = clock  # real-time admission's signal, and the route's metrics
            p.timeout_s, p.plays = self.ctx.timeout_s, True
            writer.start(p)
            async with aclosing(self.f._events(p)) as events:  # a cancel closes every stage call at once
                async for _, out in events:
                    if isinstance(out, TextDelta):
                        await writer.text(out)
                    elif isinstance(out, AudioDelta) and out.samples:
                        await writer.audio(out)
            status = "incomplete" if writer.finish == "length" else "completed"
        except asyncio.CancelledError:
            status = "cancelled"
        except OpenAIError as exc:
            status, error = "failed", exc
        except R.RealtimeProblem as problem:
            status, error = "failed", OpenAIError(problem.message, param=problem.param, code=problem.code)
        except Exception as exc:  # noqa: BLE001 - the response fails; the session goes on
            log.error("realtime session %s: response %s failed", self.id, r.id, exc_info=exc)
            status, error = "failed", OpenAIError(f"Internal server error (response {r.id}); the details are in "
                                                  "the server log.", status_code=500, type="server_error")
        finally:
            ctx.end()
        r.closing = True  # from here on a cancel waits for these events instead of cutting them
        if self.ctx.record is not None:  # the route's metrics: TTFP, gaps and stalls of each response, or its end
            self.ctx.record(writer.p.clock if writer.p is not None else None,
                            None if status in ("completed", "incomplete")
                            else error.type if error is not None else "cancelled")
        try:
            if error is not None:
                await self.send(R.server_event("error", error={
                    "type": error.type, "code": error.code, "message": error.message, "param": error.param}))
            await writer.close(status)
            await self.send(R.server_event("response.done", response=writer.view(status, r.cancel_reason, error)))
        finally:
            r.finished = True
            if self.response is r:
                self.response = None

    async def _admit(self, r: Response, ctx: RequestContext, clock: RequestClock):
        """Real-time admission of a spoken answer (``playback.admission``), its ``StreamTicket``; a session refused
        before keeps its place in the line when it asks again (admission's ``since``)."""
        asked = self.f.realtime.clock()
        try:
            ticket = await self.f.admit_stream(r.id, ctx, clock, self.f.spec.playback.admission.session_max_wait_s,
                                               since=self.asked_since)
        except OpenAIError as exc:
            if exc.status_code == 429 and self.asked_since is None:
                self.asked_since = asked
            raise
        self.asked_since = None
        return ticket

    async def _prepared(self, r: Response):
        """The chat request of the conversation for response ``r``, prepared: from the oldest item that keeps the
        audio parts within ``limits.max_media_parts``, then cut from its oldest items while it exceeds the context.
        The request is built in a thread (it base64-encodes the conversation's audio)."""
        items = list(self.items)
        start, parts = len(items), 0
        while start > 0 and parts + _audio_parts(items[start - 1]) <= self.f.spec.limits.max_media_parts:
            start -= 1
            parts += _audio_parts(items[start])
        while True:
            request = await asyncio.to_thread(self._chat_request, r, items[start:])
            try:
                return await self.f.prepare(request)
            except OpenAIError as exc:
                if exc.code != "context_length_exceeded" or start >= len(items) - 1:
                    raise
                start += 1

    def _chat_request(self, r: Response, items: list[Item]) -> P.ChatCompletionRequest:
        s, params = self.settings, r.params
        # the system turn: the instructions, else the graph's system prompt (which Qwen-Omni needs to speak), also
        # when the conversation has system items of its own
        instructions = params.instructions if params.instructions is not None else s.instructions
        messages: list[dict] = [{"role": "system",
                                 "content": instructions or self.f.spec.system_prompt or self.f.default_system_prompt}]
        for item in items:
            if item.type == "function_call":
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("_response") == item.response_id \
                        and item.response_id is not None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call],
                                     "_response": item.response_id})
            elif item.type == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            elif item.role == "assistant":
                messages.append({"role": "assistant", "content": item.text(), "_response": item.response_id})
            else:
                messages.append({"role": item.role, "content": [_chat_part(p) for p in item.parts]})
        if not any(m["role"] in ("user", "tool") for m in messages):
            raise R.RealtimeProblem("The conversation has nothing to answer yet (no user or tool item).",
                                    code="conversation_empty")
        for m in messages:
            m.pop("_response", None)
        tools = params.tools if params.tools is not None else s.tools
        choice = params.tool_choice if params.tool_choice is not None else s.tool_choice
        forced = bool(tools) and choice not in ("auto", "none")
        modalities = params.output_modalities or s.output_modalities
        limit = params.max_output_tokens if params.max_output_tokens is not None else s.max_output_tokens
        temperature = params.temperature if params.temperature is not None else s.temperature
        body: dict[str, Any] = {"model": self.f.spec.model_name, "messages": messages,
                                "modalities": ["text"] if forced or "audio" not in modalities else ["text", "audio"]}
        if "audio" in body["modalities"]:
            body["audio"] = {"voice": s.audio.output.voice or self.f.spec.default_voice, "format": "pcm16"}
        if limit != "inf":
            body["max_tokens"] = limit
        if temperature is not None:
            body["temperature"] = temperature
        seed = params.seed if params.seed is not None else s.seed
        if seed is not None:
            body["seed"] = seed
        if tools:
            body["tools"] = [t.chat_tool().model_dump(exclude_none=True) for t in tools]
            body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                          "function": {"name": choice.name}}
        try:
            return P.ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise R.problem_of(exc, None) from None

    # -- helpers --------------------------------------------------------------------------------------------
    def _session_view(self) -> dict:
        view = self.settings.view(self.id, self.f.spec.model_name)
        view["audio"]["output"]["voice"] = self.settings.audio.output.voice or self.f.spec.default_voice
        return view

    def _check_voice(self, voice: str | None, param: str, event_id: str | None) -> None:
        if voice is None:
            return
        try:
            self.f._voice(voice, param)
        except OpenAIError as exc:
            raise R.RealtimeProblem(exc.message, param=param, event_id=event_id) from None

    def _item_of(self, given, event_id: str | None) -> Item:
        item_id = given.id or R.new_id("item")
        if given.type == "function_call":
            if arguments_object(given.arguments) is None:
                raise R.RealtimeProblem("A function_call's arguments must be a JSON object (as text).",
                                        param="item.arguments", event_id=event_id)
            return Item(item_id, "function_call", call_id=given.call_id, name=given.name, arguments=given.arguments)
        if given.type == "function_call_output":
            return Item(item_id, "function_call_output", call_id=given.call_id, output=given.output)
        parts = []
        for j, c in enumerate(given.content):
            param = f"item.content[{j}]"
            if given.role == "assistant":
                if c.type not in ("text", "output_text") or c.text is None:
                    raise R.RealtimeProblem("An assistant message's content is output_text (assistant audio cannot "
                                            "be added).", param=param, event_id=event_id)
                parts.append({"type": "output_text", "text": c.text})
            elif c.type == "input_text" and c.text is not None:
                parts.append({"type": "input_text", "text": c.text})
            elif c.type == "input_audio" and c.audio is not None and given.role == "user":
                audio = pcm16(c.audio, param + ".audio", event_id)
                if len(audio) / BYTES_PER_MS > self.max_buffer_ms:
                    raise R.RealtimeProblem(f"The audio is longer than {self.max_buffer_ms / 1000:g} s.",
                                            param=param + ".audio", event_id=event_id)
                parts.append({"type": "input_audio", "transcript": None, "audio": audio})
            else:
                raise R.RealtimeProblem(f"A {given.role} message's content is input_text"
                                        f"{' or input_audio' if given.role == 'user' else ''}, with its data.",
                                        param=param, event_id=event_id)
        return Item(item_id, "message", role=given.role, parts=parts)

    def _insert(self, item: Item, previous_id: str | None, event_id: str | None) -> str | None:
        if previous_id is None:
            previous = self.items[-1].id if self.items else None
            self.items.append(item)
            return previous
        if previous_id == "root":
            self.items.insert(0, item)
            return None
        at = self.items.index(self._find(previous_id, event_id, "previous_item_id"))
        self.items.insert(at + 1, item)
        return previous_id

    def _find(self, item_id: str, event_id: str | None, param: str = "item_id") -> Item:
        for item in self.items:
            if item.id == item_id:
                return item
        raise R.RealtimeProblem(f"No item with id {item_id!r}.", code="item_not_found", param=param,
                                event_id=event_id)


def _audio_parts(item: Item) -> int:
    return sum(p["type"] == "input_audio" for p in item.parts)


def _chat_part(part: dict) -> dict:
    if part["type"] == "input_audio":
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(part["audio"]).decode(),
                                                       "format": "pcm16"}}
    return {"type": "text", "text": part["text"]}

