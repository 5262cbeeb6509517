"""A JSON ``response_format`` on the served Qwen2.5-Omni graph: constrained decoding through the official client,
streamed and not, with speech too; schemas the grammar engine cannot use are 400s before any stage runs."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.integration
MODEL = "qwen2.5-omni"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


def test_a_json_schema_reply_is_json_the_schema_accepts_streamed_and_not(omni_app):
    """Greedy and sampled, streamed and not, with speech or not: the reply parses and the schema accepts it (and the
    streamed text is the non-streamed one); json_object gives an object. Control: without a format, the tiny model's
    reply is not JSON."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{omni_app}/v1", api_key="unused")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=40, seed=5)
    greedy = client.chat.completions.create(**kw, temperature=0, response_format=JSON_SCHEMA)
    text = greedy.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert greedy.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**kw, temperature=0, response_format=JSON_SCHEMA, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    for seed in range(3):
        sampled = client.chat.completions.create(**{**kw, "seed": seed}, temperature=1.0, response_format=JSON_SCHEMA)
        jsonschema.validate(json.loads(sampled.choices[0].message.content), SCHEMA)
    spoken = client.chat.completions.create(**kw, temperature=0, response_format=JSON_SCHEMA,
                                            modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"})
    assert spoken.choices[0].message.audio.transcript == text
    obj = client.chat.completions.create(**{**kw, "max_tokens": 64}, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # the length cut a (valid so far) object: it opens like one
        assert obj.choices[0].message.content.startswith("{")
    free = client.chat.completions.create(**kw, temperature=0)
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


def test_logprobs_of_a_constrained_reply_are_the_masked_distributions(http):
    """With a grammar, most alternatives are ruled out: their logprob is vLLM's floor (-9999), never an infinity
    (not JSON); once the JSON is complete, the end token has all the mass."""
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "temperature": 0,
        "response_format": JSON_SCHEMA, "logprobs": True, "top_logprobs": 5})
    assert r.status_code == 200 and "Infinity" not in r.text and "NaN" not in r.text, r.text[:300]
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert any(t["logprob"] == -9999.0 for e in content for t in e["top_logprobs"])
    assert all(e["logprob"] > -9999.0 for e in content)  # every chosen token was allowed
    assert content[-1]["token"] == "<|im_end|>" and content[-1]["logprob"] == pytest.approx(0.0, abs=1e-5)
    assert content[-1]["top_logprobs"][1]["logprob"] == -9999.0  # once the JSON is complete, nothing else


@pytest.mark.parametrize(("response_format", "extra", "param", "words"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}, {},
     "response_format.json_schema.schema", "cannot be used"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}, {},
     "response_format.json_schema.schema", "does not exist"),
    ({"type": "json_schema"}, {}, "response_format", "needs json_schema"),
    ({"type": "yaml"}, {}, "response_format.type", "json_object"),
    ({"type": "json_object"}, {"min_tokens": 2}, "min_tokens", "cannot be combined"),
])
def test_formats_that_cannot_constrain_are_400s(http, response_format, extra, param, words):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                "max_tokens": 4, "response_format": response_format, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
