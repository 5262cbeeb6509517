"""Constrained decoding (omni_serve.engines.constraints) on the tiny checkpoint's tokenizer: whatever the logits,
a reply that follows the mask is JSON that the schema accepts, then the end token; bad schemas are reported."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from omni_serve.engines.constraints import GrammarCompiler, GrammarError

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
END = 2  # <|im_end|> in the tiny tokenizer


@pytest.fixture(scope="module")
def compiler(omni_tiny_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(omni_tiny_dir)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == END
    compiler = GrammarCompiler(tokenizer, 520, END)  # 8 logits rows past the tokenizer's 512 words
    compiler.decode = tokenizer.decode
    return compiler


@pytest.mark.parametrize("seed", range(8))
def test_any_logits_through_the_mask_give_json_the_schema_accepts(compiler, seed):
    constraint = compiler.constraint(compiler.json_grammar(SCHEMA))
    gen = torch.Generator().manual_seed(seed)
    tokens = []
    for _ in range(64):
        logits = constraint.mask(torch.randn(520, generator=gen) * 5)
        assert torch.isinf(logits[512:]).all()  # rows past the tokenizer's words are never allowed
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        tokens.append(token)
        if token == END:
            break
        constraint.advance(token)
    assert tokens[-1] == END
    text = compiler.decode(tokens[:-1])
    assert " " not in text  # compact JSON
    jsonschema.validate(json.loads(text), SCHEMA)


def test_once_complete_only_the_end_token_is_allowed(compiler):
    constraint = compiler.constraint(compiler.json_grammar({"enum": [True]}))
    text = "true"
    for token in compiler.tokenizer.tokenize_str(text):
        constraint.advance(token)
    assert torch.nonzero(constraint.allowed()).flatten().tolist() == [END]
    with pytest.raises(GrammarError, match="refused"):
        compiler.constraint(compiler.json_grammar({"enum": [True]})).advance(END + 100)


def test_schemas_the_engine_cannot_use_are_reported(compiler):
    assert compiler.check(compiler.json_grammar(SCHEMA)) == ""
    assert "bogus" in compiler.check(compiler.json_grammar({"type": "bogus"}))
    assert "does not exist" in compiler.check(compiler.json_grammar({"$ref": "#/nothing"}))
    for empty in ({"enum": []}, {"not": {}}, {"type": "integer", "minimum": 5, "maximum": 1}):
        assert compiler.check(compiler.json_grammar(empty)), empty
    with pytest.raises(GrammarError):
        compiler.json_grammar("{not json")
