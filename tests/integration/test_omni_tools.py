"""Tool calling on the served Qwen2.5-Omni graph through the official client: a forced (named) call, streamed and not,
its arguments following the tool's schema; the round trip (call -> tool result -> answer) on the prompt the
checkpoint's chat template renders; what is not served is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.integration
MODEL = "qwen2.5-omni"
PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer",
                                                                                       "minimum": 1, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "The time."}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SYSTEM = {"role": "system", "content": "You answer briefly."}
USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def client(omni_app):
    from openai import OpenAI

    return OpenAI(base_url=f"{omni_app}/v1", api_key="unused")


def test_a_forced_call_parses_and_follows_the_schema_streamed_and_not(client):
    """A named tool_choice: the reply is one call of that function (content null, finish_reason tool_calls) whose
    arguments the schema accepts, greedy and sampled; streamed, the call comes as one delta with the same name and
    arguments. 'required' calls one of the tools. Control: 'auto' on the tiny model calls nothing."""
    kw = dict(model=MODEL, messages=[SYSTEM, USER], tools=TOOLS, max_tokens=96, seed=3)
    reply = client.chat.completions.create(**kw, temperature=0, tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)

    deltas = [c.choices[0] for c in client.chat.completions.create(**kw, temperature=0, tool_choice=NAMED, stream=True)
              if c.choices]
    streamed = [t for d in deltas for t in d.delta.tool_calls or ()]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (0, "get_weather", call.function.arguments)]
    assert streamed[0].id.startswith("call_") and not any(d.delta.content for d in deltas)
    assert deltas[-1].finish_reason == "tool_calls"

    for seed in range(3):
        sampled = client.chat.completions.create(**{**kw, "seed": seed}, temperature=1.0, tool_choice="required")
        calls = sampled.choices[0].message.tool_calls
        assert calls and all(c.function.name in ("get_weather", "get_time") for c in calls)
        for c in calls:
            if c.function.name == "get_weather":
                jsonschema.validate(json.loads(c.function.arguments), PARAMS)
    free = client.chat.completions.create(**kw, temperature=0, tool_choice="auto")
    assert free.choices[0].message.tool_calls is None and free.choices[0].finish_reason in ("stop", "length")


def test_the_round_trip_answers_on_the_templates_prompt(client, http, omni_tiny_dir):
    """call -> tool result -> answer: the answer to the history (the call sent back as the assistant's tool_calls,
    the result as a tool message) is the thinker's greedy continuation of the prompt the checkpoint's template
    renders for it (the same tokens as /v1/completions on that text); the call renders as the model wrote it.
    Control: without the tool result the prompt differs."""
    from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor

    first = client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER], tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=96, extra_body={"return_token_ids": True})
    call = first.choices[0].message.tool_calls[0]
    history = [SYSTEM, USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear", "c": 21})}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=12,
                                            extra_body={"return_token_ids": True})
    inputs = OmniInputProcessor(omni_tiny_dir)
    rendered = inputs.render([{**m, "content": m["content"] or ""} for m in history], TOOLS)
    generated = inputs.tokenizer.decode(first.choices[0].token_ids, skip_special_tokens=True)
    assert f"<|im_start|>assistant\n{generated}<|im_end|>" in rendered  # the call, as the model wrote it
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": rendered, "temperature": 0, "max_tokens": 12,
                                           "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert answer.usage.prompt_tokens == r.json()["usage"]["prompt_tokens"]
    assert answer.choices[0].token_ids == r.json()["choices"][0]["token_ids"]
    without = client.chat.completions.create(model=MODEL, messages=history[:3], tools=TOOLS, max_tokens=1)
    assert without.usage.prompt_tokens < answer.usage.prompt_tokens


def test_one_call_at_most_when_parallel_calls_are_off(client):
    reply = client.chat.completions.create(model=MODEL, messages=[USER], tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=96)
    assert len(reply.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tools": TOOLS, "modalities": ["text", "audio"]}, "tools", "text output only"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}],
      "tool_choice": "required"}, "tool_choice", "cannot be used"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
])
def test_tool_requests_that_are_not_served_are_400s(http, extra, param, words):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [USER], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_the_vllm_omni_stream_shape_refuses_tools(http):
    r = http.post("/v1/chat/completions", headers={"X-Omni-Stream-Format": "vllm_omni"},
                  json={"model": MODEL, "messages": [USER], "tools": TOOLS, "stream": True, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
