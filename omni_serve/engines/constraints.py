"""Constrained decoding: the tokens a grammar allows at each step, from llguidance.

Contract: ``GrammarCompiler(tokenizer, vocab_size, end_token)`` wraps a checkpoint's (fast) Hugging Face tokenizer
once (llguidance reads every token's bytes; about a second for a real vocabulary, so one compiler per replica);
``compiler.json_grammar(schema)`` compiles a JSON schema into a grammar (compact JSON: no whitespace between
tokens, so a model cannot stall in whitespace) and ``compiler.check(grammar)`` says what keeps it from
constraining a reply ('' when nothing; a schema that accepts no value is reported too).
``compiler.constraint(grammar)`` starts one request's ``TokenConstraint``: ``mask(logits)`` returns the logits
with every token the grammar does not allow next set to -inf (once the grammar is complete, only ``end_token``
is allowed), and ``advance(token)`` moves the grammar past the sampled token.

llguidance is a maintained grammar engine (vLLM's ``guidance`` structured-output backend), not ours: the vLLM
thinker is configured to use it too, so both backends constrain a reply identically. Its helpers for applying
the mask to torch tensors go through ``torch.compile``; the mask is applied here with ``torch.where`` on the
unpacked bitmask instead (no compiler on the serving path).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (what vLLM's disable_any_whitespace asks too)


class GrammarError(ValueError):
    """A grammar (or the schema it came from) that llguidance cannot use; the message says why."""


class TokenConstraint:
    """One request's grammar state (see the module doc)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size

    def allowed(self) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens the grammar allows next (a ``GrammarError`` once the grammar failed, e.g.
        on one of llguidance's resource limits: that request fails instead of ending as if its JSON were complete)."""
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
        if allowed.size < self.vocab_size:  # logits rows past the tokenizer's words: never allowed
            allowed = np.concatenate([allowed, np.zeros(self.vocab_size - allowed.size, dtype=bool)])
        return torch.from_numpy(allowed)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        allowed = self.allowed().to(logits.device).view(logits.shape)
        return torch.where(allowed, logits, torch.tensor(-float("inf"), dtype=logits.dtype, device=logits.device))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, end_token: int):
        import llguidance.hf

        self.vocab_size, self.end_token = vocab_size, end_token
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=end_token)

    @staticmethod
    def json_grammar(schema: dict[str, Any] | str) -> str:
        from llguidance import LLMatcher

        try:
            return LLMatcher.grammar_from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                      defaults=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None

    def check(self, grammar: str) -> str:
        """What keeps ``grammar`` from constraining a reply ('' when nothing; warnings do not count): llguidance's
        validation, and a grammar whose language is empty (no first token but the end)."""
        from llguidance import LLMatcher

        problem = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            return problem
        try:
            first = self.constraint(grammar).allowed()
        except GrammarError as exc:
            return str(exc)
        first[self.end_token] = False
        return "" if first.any() else "the schema accepts no JSON value"

    def constraint(self, grammar: str) -> TokenConstraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return TokenConstraint(matcher, self.vocab_size)
