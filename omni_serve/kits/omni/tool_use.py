"""Tool calling on the Omni chat route: what a request's ``tools`` / ``tool_choice`` ask of the prompt, the thinker and
the reply (the format and its parser are ``omni_serve.api.tools``').

Contract: ``tool_plan(req, renders_tools)`` returns the request's ``ToolPlan`` (None when it uses no tools: none
given, or ``tool_choice: "none"``, whose tools are not shown to the model) or raises the 400 of a combination that
is not served: tools with audio output (the talker would speak the call), with a JSON ``response_format`` or
``min_tokens`` (one constraint per reply), or on a checkpoint whose chat template does not render tools. The plan
says what the template renders (``tools``), the grammar a forced call is constrained by (``grammar``: with
``required`` or a named function; None with ``auto``) and the stop strings it adds (``auto`` without parallel calls
ends the reply at the first call's closing tag). ``history_calls(msg, i)`` is an assistant message's ``tool_calls``
as the chat template reads them, each call's ``arguments`` checked to be a JSON object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_serve.api import protocol as P
from omni_serve.api.errors import bad_request
from omni_serve.api.tools import CLOSE, arguments_object, template_tools, tool_call_grammar


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # as the chat template renders them
    grammar: str | None  # the Lark grammar a forced call follows; None: the model may answer freely ('auto')
    stop: tuple[str, ...] = ()  # stop strings the plan adds


def tool_plan(req: P.ChatCompletionRequest, renders_tools: bool) -> ToolPlan | None:
    mode = req.tool_mode()
    if mode is None:
        return None
    if not renders_tools:
        raise bad_request("This model's chat template does not render tools, so the model cannot be shown them; "
                          "send the request without tools (or with tool_choice \"none\").", param="tools")
    if req.wants_audio():
        raise bad_request("Tools are served with text output only (the talker would speak the call); ask for "
                          "modalities [\"text\"], or send tool_choice \"none\".", param="tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise bad_request("A JSON response_format cannot be combined with tools (one constraint per reply); send "
                          "one of them.", param="response_format")
    parallel = req.parallel_tool_calls is not False
    grammar = None if mode == "auto" else tool_call_grammar(req.tools, mode, parallel)
    if grammar is not None and req.min_tokens:
        raise bad_request("min_tokens cannot be combined with a forced tool call (the grammar may end the reply "
                          "first).", param="min_tokens")
    stop = (CLOSE,) if mode == "auto" and not parallel else ()
    return ToolPlan(template_tools(req.tools), grammar, stop)


def history_calls(msg: P.ChatMessage, i: int) -> list[dict[str, Any]]:
    """An assistant message's calls for the chat template (a 400 for one whose arguments are not a JSON object)."""
    if msg.role != "assistant":
        raise bad_request(f"Only assistant messages may have tool_calls (message {i} is {msg.role}).",
                          param=f"messages[{i}].tool_calls")
    calls = []
    for j, call in enumerate(msg.tool_calls):
        if arguments_object(call.function.arguments) is None:
            raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object (as text).",
                              param=f"messages[{i}].tool_calls[{j}].function.arguments")
        calls.append({"type": "function", "function": {"name": call.function.name,
                                                        "arguments": call.function.arguments}})
    return calls
