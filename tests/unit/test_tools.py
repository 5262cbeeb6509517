"""Tool calling's pieces without a model: the parser of Qwen's <tool_call> blocks (whole and streamed), the grammar of a
forced call (driven through llguidance on a tiny checkpoint's tokenizer), the chat template's tool layout (the
reply's calls fed back render as the model wrote them), the request's validation and the 400s of what is not served."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from omni_serve.api import protocol as P
from omni_serve.api.errors import OpenAIError
from omni_serve.api.tools import ChatTool, NamedToolChoice, ToolCallStream, parse_tool_calls, tool_call_grammar
from omni_serve.kits.omni.tool_use import history_calls, tool_plan


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


def _pieces(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


def test_a_reply_splits_into_content_and_calls():
    content, calls = parse_tool_calls("Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    assert content == "Let me look."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome", "days": 3})]
    assert calls[0].function.arguments == '{"city": "Paris", "days": 3}'  # as the template writes it back
    assert len({c.id for c in calls}) == 2 and calls[0].id.startswith("call_")
    assert parse_tool_calls(CALL)[0] is None  # only calls: no content
    assert parse_tool_calls("plain text") == ("plain text", [])


@pytest.mark.parametrize("text", [
    "<tool_call>\nnot json\n</tool_call> after",  # a block that is no call stays content
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",  # no name
    "a < b and <tool",  # a partial tag at the end
    "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",  # arguments not an object
])
def test_text_that_is_not_a_call_stays_content_whole(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_block_cut_off_by_the_end_of_the_reply_is_a_call_when_its_json_is_whole():
    content, calls = parse_tool_calls(CALL[:-len("</tool_call>")])  # a stop string ended the reply there
    assert content is None and calls[0].function.name == "get_weather"
    assert parse_tool_calls('<tool_call>\n{"name": "get_w') == ('<tool_call>\n{"name": "get_w', [])


@pytest.mark.parametrize("seed", range(6))
def test_a_streamed_reply_gives_the_same_content_and_calls_in_order(seed):
    """Whatever the pieces, the streamed content concatenates to the whole reply's and the calls come whole, in order,
    each after the content before it; no piece of a tag is sent as content."""
    text = "Sure <b>x</b> " + CALL + "\n" + CALL.replace("3", "4") + "\n"
    stream, out = ToolCallStream(), []
    for piece in _pieces(text, seed):
        out.extend(stream.feed(piece))
    out.extend(stream.finish())
    content = "".join(p for p in out if isinstance(p, str))
    assert content.strip() == parse_tool_calls(text)[0] and "<tool" not in content
    calls = [p for p in out if not isinstance(p, str)]
    assert [json.loads(c.function.arguments)["days"] for c in calls] == [3, 4]
    first_call = next(i for i, p in enumerate(out) if not isinstance(p, str))
    assert "".join(out[:first_call]) == "Sure <b>x</b> "  # the content before it, all of it


@pytest.fixture(scope="module")
def matcher_for(omni_tiny_dir):
    import llguidance.hf
    from llguidance import LLMatcher
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(omni_tiny_dir)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok), eos_token=end)

    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(lltok, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        return all(m.consume_token(t) for t in tok.encode(text)) and m.is_accepting()
    return accepts


def test_a_forced_calls_grammar_accepts_exactly_the_calls_the_choice_allows(matcher_for):
    tools = [ChatTool(**WEATHER), ChatTool(**TIME)]
    named = tool_call_grammar(tools, NamedToolChoice(type="function", function={"name": "get_weather"}), True)
    assert matcher_for(named, CALL)
    assert matcher_for(named, CALL + "\n" + CALL)  # parallel: more calls of it
    assert not matcher_for(named, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not matcher_for(named, CALL.replace('"days": 3', '"days": "3"'))  # the schema holds
    assert not matcher_for(named, CALL.replace('"city": "Paris", "days"', '"city":"Paris","days"'))  # template's JSON
    assert not matcher_for(named, "Sure. " + CALL)  # nothing before the call
    single = tool_call_grammar(tools, "required", False)
    assert matcher_for(single, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')  # no parameters
    assert matcher_for(single, CALL)
    assert not matcher_for(single, CALL + "\n" + CALL)  # parallel_tool_calls false: one call


def test_calls_fed_back_render_as_the_model_wrote_them(omni_tiny_dir):
    """The checkpoint's template shows the tools in the system turn; a reply's parsed calls, sent back as the
    assistant's tool_calls, render as the text the model generated (its KV prefix is the same), and tool results
    come back as tool_response blocks of one user turn. Without tools the template renders as before."""
    from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor

    inputs = OmniInputProcessor(omni_tiny_dir)
    assert inputs.renders_tools
    reply = "Checking.\n" + CALL
    content, calls = parse_tool_calls(reply)
    req = P.ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
        {"role": "tool", "tool_call_id": "x", "content": [{"type": "text", "text": "warm"}]}], tools=[WEATHER])
    history = [{"role": m.role, "content": m.content if isinstance(m.content, str) else m.content[0].text,
                **({"tool_calls": history_calls(m, i)} if m.tool_calls else {})} for i, m in enumerate(req.messages)]
    text = inputs.render(history, [WEATHER])
    assert "<|im_start|>assistant\n" + reply + "<|im_end|>\n" in text
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwarm\n</tool_response><|im_end|>" in text
    assert json.dumps(WEATHER) in text.split("<|im_start|>user")[0]  # the tools, in the system turn
    assert "<tools>" not in inputs.render(history[:1])


def _request(**kw) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


@pytest.mark.parametrize(("kw", "words"), [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "pattern"),
    ({"tools": [{"type": "retrieval"}]}, "function"),
    ({"tools": [TIME] * 129}, "at most 128"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "of an object"),
])
def test_tool_fields_that_make_no_sense_are_validation_errors(kw, words):
    with pytest.raises(ValidationError, match=words):
        _request(**kw)


def test_what_tools_ask_of_the_thinker():
    assert tool_plan(_request(), True) is None
    assert tool_plan(_request(tools=[WEATHER], tool_choice="none"), True) is None  # not shown, not parsed
    auto = tool_plan(_request(tools=[WEATHER]), True)
    assert auto.grammar is None and auto.stop == () and auto.tools == [WEATHER]
    assert tool_plan(_request(tools=[WEATHER], parallel_tool_calls=False), True).stop == ("</tool_call>",)
    forced = tool_plan(_request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                     "function": {"name": "get_time"}}), True)
    assert "get_time" in forced.grammar and "get_weather" not in forced.grammar


@pytest.mark.parametrize(("kw", "renders", "param"), [
    ({"tools": [WEATHER]}, False, "tools"),
    ({"tools": [WEATHER], "modalities": ["text", "audio"]}, True, "tools"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, True, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "min_tokens": 3}, True, "min_tokens"),
])
def test_combinations_not_served_are_400s_naming_the_field(kw, renders, param):
    with pytest.raises(OpenAIError) as err:
        tool_plan(_request(**kw), renders)
    assert err.value.status_code == 400 and err.value.param == param


def test_history_calls_need_object_arguments_on_assistant_messages():
    bad = P.ChatMessage(role="assistant", tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "[1]"}}])
    with pytest.raises(OpenAIError) as err:
        history_calls(bad, 2)
    assert err.value.param == "messages[2].tool_calls[0].function.arguments"
    user = P.ChatMessage(role="user", content="x", tool_calls=[{"id": "c", "function": {"name": "f", "arguments": "{}"}}])
    with pytest.raises(OpenAIError, match="Only assistant"):
        history_calls(user, 0)
