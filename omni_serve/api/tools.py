"""OpenAI tool calling over Qwen's ``<tool_call>`` format: the request and response models, the parser of a reply's
calls (whole or streamed) and the grammar that makes a forced call parse.

Contract:

* ``ChatTool`` / ``ToolChoice`` are what the official client sends in ``tools`` / ``tool_choice``; ``ToolCall`` (a
  reply's call, ``arguments`` a JSON text) and ``DeltaToolCall`` (a streamed one) what it reads back.
* The model writes each call as Qwen's chat templates teach it (Qwen2.5/Qwen3 and Qwen3-Omni's ``tool_call``
  section): ``<tool_call>\\n{"name": <name>, "arguments": <object>}\\n</tool_call>``, several calls separated by a
  newline. ``parse_tool_calls(text)`` splits a finished reply into (content, calls); ``ToolCallStream`` does the
  same for text that arrives in pieces: ``feed(text)`` returns what can be sent now (content pieces and whole
  calls, in order; text that may open a call is held back), ``finish()`` what is left. A block whose JSON does not
  parse as a call stays content (a model that writes the tag by accident loses no text); a block cut off by the end
  of the reply (a stop string, the token limit) is a call if its JSON is whole.
* ``tool_call_grammar(tools, choice, parallel)`` is the Lark grammar (llguidance's dialect: ``%json`` takes a JSON
  schema) of the replies a ``required`` or named ``tool_choice`` allows: one call (or, with ``parallel``, one or
  more) of the allowed functions, each ``arguments`` valid under the function's ``parameters`` schema and written
  as the template writes it (``json.dumps``' separators), nothing before or after. The thinkers constrain the reply
  with it (``omni_serve.engines.constraints``), so a forced call always parses.

Streamed calls are sent whole: one ``DeltaToolCall`` with the id, name and complete arguments once the call's
closing tag (or the reply's end) arrives, which OpenAI's stream format allows (clients concatenate the argument
pieces of an index; here there is one).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128  # OpenAI's limit on the number of tools a request may give
# json.dumps' separators: how the chat template's ``tojson`` writes arguments, so a forced call reads as the model saw
# its calls written in its prompt
ARGUMENT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Lenient):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$",
                      description="The function's name (a-z, 0-9, _ and -, up to 64).")
    description: str | None = Field(default=None, description="What the function does (shown to the model).")
    parameters: dict[str, Any] | None = Field(default=None, description=(
        "JSON schema of the function's arguments (an object); None: no arguments (an empty object)."))
    strict: bool | None = Field(default=None, description=(
        "Accepted; forced calls (tool_choice required or named) always follow the schema, strict or not."))

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise PydanticCustomError("invalid_parameters", "parameters must be the JSON schema of an object (its "
                                      "type 'object'), not {type}", {"type": json.dumps(value.get("type"))})
        return value


class ChatTool(_Lenient):
    type: Literal["function"] = Field(description="Tool kind: only functions.")
    function: FunctionDefinition = Field(description="The function the model may call.")


class ToolChoiceFunction(_Lenient):
    name: str = Field(description="The function that must be called.")


class NamedToolChoice(_Lenient):
    type: Literal["function"] = Field(description="Tool kind: only functions.")
    function: ToolChoiceFunction = Field(description="Which function.")


ToolChoice = Annotated[
    Union[
        Annotated[Literal["none", "auto", "required"], Tag("choice[str]")],
        Annotated[NamedToolChoice, Tag("choice[named]")],
    ],
    Discriminator(
        lambda v: "choice[str]" if isinstance(v, str) else "choice[named]" if isinstance(v, (dict, BaseModel))
        else None,
        custom_error_type="invalid_tool_choice",
        custom_error_message="tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                             "{'name': ...}}",
    ),
]


class FunctionCall(BaseModel):
    name: str = Field(description="The called function's name.")
    arguments: str = Field(description="Its arguments, a JSON object as text.")


class ToolCall(BaseModel):
    """A call in a reply (``message.tool_calls``), and in the history a client sends back."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(description="The call's id; the tool message answering it names it as tool_call_id.")
    type: Literal["function"] = Field(default="function", description="Always 'function'.")
    function: FunctionCall = Field(description="What is called, with which arguments.")


class DeltaFunctionCall(BaseModel):
    name: str | None = Field(default=None, description="The function's name (with the call's first delta).")
    arguments: str | None = Field(default=None, description="A piece of the arguments' JSON text.")


class DeltaToolCall(BaseModel):
    index: int = Field(description="Which call of the reply (0, 1, ...): deltas of one index concatenate.")
    id: str | None = Field(default=None, description="The call's id (with its first delta).")
    type: Literal["function"] | None = Field(default=None, description="'function' (with its first delta).")
    function: DeltaFunctionCall = Field(description="The name and arguments this delta adds.")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _as_call(block: str) -> ToolCall | None:
    """The call a ``<tool_call>`` block's body writes, or None when it is not one (not a JSON object with a string
    ``name`` and object ``arguments``)."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(id=new_call_id(), function=FunctionCall(name=obj["name"],
                                                            arguments=json.dumps(args, ensure_ascii=False)))


class ToolCallStream:
    """Splits a reply arriving in pieces into content and calls (see the module doc)."""

    def __init__(self):
        self._buffer = ""  # text not sent yet: a possible start of OPEN, or an open block
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buffer += text
        out: list[str | ToolCall] = []
        while True:
            start = self._buffer.find(OPEN)
            if start < 0:  # send all but a tail that may begin OPEN
                keep = _partial_suffix(self._buffer, OPEN)
                self._emit(out, self._buffer[:len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep:]
                return out
            end = self._buffer.find(CLOSE, start)
            if end < 0:  # an open block: hold it until it closes (or the reply ends)
                self._emit(out, self._buffer[:start])
                self._buffer = self._buffer[start:]
                return out
            self._emit(out, self._buffer[:start])
            self._block(out, self._buffer[start:end + len(CLOSE)])
            self._buffer = self._buffer[end + len(CLOSE):]

    def finish(self) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        rest, self._buffer = self._buffer, ""
        if rest.startswith(OPEN):
            self._block(out, rest)
        else:
            self._emit(out, rest)
        return out

    def _block(self, out: list, block: str) -> None:
        body = block[len(OPEN):]
        call = _as_call(body[:-len(CLOSE)] if body.endswith(CLOSE) else body)
        if call is None:
            self._emit(out, block)
        else:
            self.calls.append(call)
            out.append(call)

    def _emit(self, out: list, text: str) -> None:
        if not text:
            return
        if self.calls and not text.strip():  # the newlines between calls (and after the last) are not content
            return
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply: the content is the text around the calls, stripped (None when only
    calls remain)."""
    stream = ToolCallStream()
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str)).strip()
    return (content or None) if stream.calls else text, stream.calls


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string literal is a Lark string literal


def tool_call_grammar(tools: list[ChatTool], choice: str | NamedToolChoice, parallel: bool) -> str:
    """The Lark grammar of the replies ``choice`` (``required`` or named) allows (see the module doc)."""
    allowed = [t for t in tools if isinstance(choice, str) or t.function.name == choice.function.name]
    rules = []
    for i, tool in enumerate(allowed):
        schema = dict(tool.function.parameters or {"type": "object", "properties": {}, "additionalProperties": False})
        schema["type"] = "object"  # what the parser takes as arguments (a schema may leave its type out)
        schema["x-guidance"] = ARGUMENT_JSON
        head = f'{OPEN}\n{{"name": {json.dumps(tool.function.name)}, "arguments": '
        rules.append(f"call_{i}: {_lark_string(head)} args_{i} {_lark_string('}' + chr(10) + CLOSE)}\n"
                     f"args_{i}: %json {json.dumps(schema)}")
    calls = " | ".join(f"call_{i}" for i in range(len(allowed)))
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, f"call: {calls}", *rules])


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """``tools`` as the chat template reads them (OpenAI's shape, the absent fields left out)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def arguments_object(arguments: str) -> dict[str, Any] | None:
    """A history call's ``arguments`` text as the object it must be, or None when it is not one."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

