"""OpenAI's Realtime API (GA): the client events a session accepts, the session's settings and the server events'
envelope.

Contract:

* ``parse_client_event(text)`` returns the validated client event (one of ``CLIENT_EVENTS``' models) or raises
  ``RealtimeProblem`` (``code``, ``message``, ``param``, the offending ``event_id``): malformed JSON, an unknown
  ``type``, a field that fails validation. The session answers a problem with an ``error`` event and keeps the
  connection open.
* ``SessionSettings`` is a session's state as ``session.update`` changes it: only the fields a client sent are
  replaced (``SessionSettings.updated``); ``SessionSettings.view()`` is the ``session`` object of
  ``session.created`` / ``session.updated`` as the official client parses it (``RealtimeSessionCreateRequest``).
* ``server_event(type, **fields)`` is a server event with a fresh ``event_id`` (a dict, sent as JSON).

Audio is pcm16 at 24 kHz mono both ways (``audio/pcm``, rate 24000): G.711 (``audio/pcmu``, ``audio/pcma``) is
refused with a problem naming the field. Turn detection is ``server_vad`` or none (``semantic_vad`` is refused).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from omni_serve.api.tools import ChatTool

PCM_RATE = 24000  # the only audio format: pcm16 mono at 24 kHz, in and out
PCM_FORMAT = {"type": "audio/pcm", "rate": PCM_RATE}


class RealtimeProblem(Exception):
    """A client event the session cannot use (answered by an ``error`` event; the connection stays open)."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.code, self.param, self.event_id, self.type = message, code, param, event_id, type

    def event(self) -> dict:
        error = {"type": self.type, "code": self.code, "message": self.message, "param": self.param,
                 "event_id": self.event_id}
        return server_event("error", error={k: v for k, v in error.items() if v is not None})


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


def server_event(type: str, **fields: Any) -> dict:
    return {"type": type, "event_id": new_id("event"), **fields}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- session settings ------------------------------------------------------------------------------------------
class AudioFormat(_Lenient):
    type: Literal["audio/pcm"] = Field(default="audio/pcm", description="pcm16 mono (G.711 is not served).")
    rate: Literal[24000] = Field(default=PCM_RATE, description="Samples per second: 24000.")


class ServerVad(_Lenient):
    type: Literal["server_vad"] = Field(description="Voice activity detection on the server (Silero VAD).")
    threshold: float = Field(default=0.5, ge=0.2, le=1, description=(
        "Speech probability that starts speech (Silero ends it below threshold - 0.15, so at least 0.2)."))
    prefix_padding_ms: int = Field(default=300, ge=0, le=5000, description=(
        "Audio before the detected start kept in the user's turn (ms)."))
    silence_duration_ms: int = Field(default=500, ge=0, le=10000, description="Silence that ends the turn (ms).")
    create_response: bool = Field(default=True, description="Answer each turn when its speech stops.")
    interrupt_response: bool = Field(default=True, description=(
        "Speech that starts while a response is generated cancels it (barge-in)."))
    idle_timeout_ms: int | None = Field(default=None, description="Accepted; no idle timeout is applied.")


class AudioInput(_Lenient):
    format: AudioFormat = Field(default_factory=AudioFormat, description="Input audio format.")
    transcription: None = Field(default=None, description=(
        "Not served: input audio is heard by the model, not transcribed (only null is accepted)."))
    noise_reduction: None = Field(default=None, description="Not served (only null is accepted).")
    turn_detection: ServerVad | None = Field(default_factory=lambda: ServerVad(type="server_vad"), description=(
        "server_vad, or null: the client commits the input buffer and asks for responses itself."))


class AudioOutput(_Lenient):
    format: AudioFormat = Field(default_factory=AudioFormat, description="Output audio format.")
    voice: str | None = Field(default=None, description="The checkpoint's voice (None: the graph's default_voice).")
    speed: float | None = Field(default=None, description="Accepted; speech is not time-stretched.")


class AudioConfig(_Lenient):
    input: AudioInput = Field(default_factory=AudioInput, description="Input audio settings.")
    output: AudioOutput = Field(default_factory=AudioOutput, description="Output audio settings.")


class FunctionTool(_Lenient):
    type: Literal["function"] = Field(description="Only functions.")
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="The function's name.")
    description: str | None = Field(default=None, description="What it does (shown to the model).")
    parameters: dict[str, Any] | None = Field(default=None, description="JSON schema of its arguments (an object).")

    def chat_tool(self) -> ChatTool:
        return ChatTool(type="function", function={"name": self.name, "description": self.description,
                                                   "parameters": self.parameters})


class NamedFunction(_Lenient):
    type: Literal["function"] = Field(description="Only functions.")
    name: str = Field(description="The function that must be called.")


ToolChoice = Union[Literal["auto", "none", "required"], NamedFunction]
Modalities = list[Literal["text", "audio"]]


class SessionSettings(_Lenient):
    type: Literal["realtime"] = Field(default="realtime", description="A speech-to-speech session.")
    instructions: str | None = Field(default=None, description=(
        "The system prompt (None: the graph's, which Qwen-Omni needs to answer with speech)."))
    output_modalities: Modalities = Field(default_factory=lambda: ["audio"], description=(
        "['audio'] (speech with its transcript) or ['text']."))
    audio: AudioConfig = Field(default_factory=AudioConfig, description="Audio in and out.")
    tools: list[FunctionTool] = Field(default_factory=list, max_length=128, description="Functions the model may call.")
    tool_choice: ToolChoice = Field(default="auto", description="As chat completions' tool_choice.")
    max_output_tokens: int | Literal["inf"] = Field(default="inf", description=(
        "Text tokens per response ('inf': the graph's default_max_tokens)."))
    temperature: float | None = Field(default=None, ge=0, le=2, description=(
        "Extension (the beta API's): sampling temperature (None: the graph's default)."))
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63, description=(
        "Extension: every response samples with this seed (text, codec and waveform), as a chat request with it "
        "would; None: each response draws one."))

    def updated(self, changes: dict[str, Any]) -> "SessionSettings":
        """These settings with the fields ``changes`` (a ``session.update``'s ``session``) sent replaced; nested
        objects (``audio``) merge the same way. Raises ``ValidationError``."""
        merged = merge_settings(self.model_dump(), changes)
        return SessionSettings.model_validate(merged)

    def view(self, session_id: str, model: str) -> dict:
        out = self.model_dump(exclude_none=True)
        out.update(id=session_id, object="realtime.session", model=model)
        out.setdefault("audio", {}).setdefault("input", {})["turn_detection"] = (
            self.audio.input.turn_detection.model_dump(exclude_none=True) if self.audio.input.turn_detection else None)
        return out


def merge_settings(base: dict, changes: dict) -> dict:
    """``base`` (settings as a dict) with the fields ``changes`` sent replaced; nested objects merge the same way,
    except ``turn_detection``, which is replaced whole."""
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "turn_detection":
            out[key] = merge_settings(out[key], value)
        else:
            out[key] = value
    return out


# -- conversation items a client sends ------------------------------------------------------------------------
class InputContent(_Lenient):
    type: Literal["input_text", "input_audio", "text", "output_text"] = Field(description=(
        "input_text / input_audio (user and system), text / output_text (assistant)."))
    text: str | None = Field(default=None, description="The text (input_text, text, output_text).")
    audio: str | None = Field(default=None, description="Base64 pcm16 at 24 kHz (input_audio).")
    transcript: str | None = Field(default=None, description="Accepted; input audio is heard, not its transcript.")


class MessageItem(_Lenient):
    type: Literal["message"] = Field(description="A message.")
    id: str | None = Field(default=None, description="The item's id (None: the server gives one).")
    role: Literal["user", "system", "assistant"] = Field(description="Who speaks.")
    content: list[InputContent] = Field(min_length=1, description="Its content parts.")


class FunctionCallItem(_Lenient):
    type: Literal["function_call"] = Field(description="A call the model made (history).")
    id: str | None = Field(default=None, description="The item's id.")
    call_id: str = Field(description="The call's id.")
    name: str = Field(description="The called function.")
    arguments: str = Field(description="Its arguments, a JSON object as text.")


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"] = Field(description="A call's result.")
    id: str | None = Field(default=None, description="The item's id.")
    call_id: str = Field(description="The call it answers.")
    output: str = Field(description="The result, as text.")


Item = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")]],
    Discriminator(lambda v: v.get("type") if isinstance(v, dict) else getattr(v, "type", None),
                  custom_error_type="invalid_item",
                  custom_error_message="item type must be message, function_call or function_call_output"),
]


# -- client events ---------------------------------------------------------------------------------------------
class _Event(_Lenient):
    event_id: str | None = Field(default=None, description="The client's id for the event (errors name it).")


class SessionUpdate(_Event):
    type: Literal["session.update"]
    session: dict[str, Any] = Field(description="The settings to change (SessionSettings' fields).")


class AudioAppend(_Event):
    type: Literal["input_audio_buffer.append"]
    audio: str = Field(description="Base64 pcm16 at 24 kHz mono.")


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ItemCreate(_Event):
    type: Literal["conversation.item.create"]
    previous_item_id: str | None = Field(default=None, description="Insert after this item ('root': first).")
    item: Item


class ItemTruncate(_Event):
    type: Literal["conversation.item.truncate"]
    item_id: str = Field(description="An assistant audio item.")
    content_index: int = Field(ge=0, description="Its content part (0).")
    audio_end_ms: int = Field(ge=0, description="How much of its audio the user heard (ms).")


class ItemDelete(_Event):
    type: Literal["conversation.item.delete"]
    item_id: str


class ItemRetrieve(_Event):
    type: Literal["conversation.item.retrieve"]
    item_id: str


class ResponseParams(_Lenient):
    instructions: str | None = Field(default=None, description="This response's system prompt.")
    output_modalities: Modalities | None = Field(default=None, description="This response's modalities.")
    tools: list[FunctionTool] | None = Field(default=None, description="This response's tools.")
    tool_choice: ToolChoice | None = Field(default=None, description="This response's tool_choice.")
    max_output_tokens: int | Literal["inf"] | None = Field(default=None, description="This response's limit.")
    temperature: float | None = Field(default=None, ge=0, le=2, description="Extension: its temperature.")
    seed: int | None = Field(default=None, ge=-2**63, lt=2**63, description="Extension: its seed.")
    conversation: Literal["auto", "none"] | None = Field(default=None, description=(
        "'auto' (default): the response joins the conversation; 'none' is not served."))
    input: list[Any] | None = Field(default=None, description="Not served: a response answers the conversation.")
    metadata: dict[str, str] | None = Field(default=None, description=(
        "Echoed in the response object (clients match their requests by it)."))


class ResponseCreate(_Event):
    type: Literal["response.create"]
    response: ResponseParams = Field(default_factory=ResponseParams)


class ResponseCancel(_Event):
    type: Literal["response.cancel"]
    response_id: str | None = None


ClientEvent = Union[SessionUpdate, AudioAppend, AudioCommit, AudioClear, ItemCreate, ItemTruncate, ItemDelete,
                    ItemRetrieve, ResponseCreate, ResponseCancel]
CLIENT_EVENTS: dict[str, type[BaseModel]] = {m.model_fields["type"].annotation.__args__[0]: m
                                             for m in ClientEvent.__args__}


def parse_client_event(text: str | bytes) -> ClientEvent:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RealtimeProblem(f"The event is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise RealtimeProblem("An event must be a JSON object.", code="invalid_json")
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    kind = data.get("type")
    model = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise RealtimeProblem(f"Unknown event type {kind!r}; this server accepts {', '.join(sorted(CLIENT_EVENTS))}.",
                              code="invalid_event_type", param="type", event_id=event_id)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise problem_of(exc, event_id) from None


def problem_of(exc: ValidationError, event_id: str | None, prefix: str = "") -> RealtimeProblem:
    err = exc.errors()[0]
    param = prefix + ".".join(str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal")))
    return RealtimeProblem(f"{param}: {err['msg']}" if param else err["msg"], param=param or None,
                           event_id=event_id)
