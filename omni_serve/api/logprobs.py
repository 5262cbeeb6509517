"""OpenAI's ``logprobs`` objects from token ids and log-probabilities.

Contract: ``LogprobWriter(tokenizer).entries(token_ids, logprobs)`` turns a text stage's tokens and their
``(logprob, [(alternative id, logprob), ...])`` pairs into ``ChatCompletionTokenLogprob`` entries. A token's text is
its own decode (``tokenizer.decode([id])``, special tokens kept), so a token holding part of a UTF-8 character reads
as U+FFFD, and ``bytes`` are that text's UTF-8 encoding, as vLLM's OpenAI server writes them. A token the
distribution rules out (-inf: a grammar's mask) is written as ``FLOOR`` (JSON has no infinity), as vLLM's is.
"""

from __future__ import annotations

from typing import Sequence

from omni_serve.api import protocol as P

FLOOR = -9999.0


class LogprobWriter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}  # token id -> its decode (a reply's alternatives repeat a lot)

    def _entry(self, token: int, logprob: float) -> P.TopLogprob:
        text = self._text.get(token)
        if text is None:
            text = self._text[token] = self.tokenizer.decode([token])
        return P.TopLogprob(token=text, logprob=max(logprob, FLOOR), bytes=list(text.encode("utf-8", errors="replace")))

    def entries(self, token_ids: Sequence[int],
                logprobs: Sequence[tuple[float, Sequence[tuple[int, float]]]]) -> list[P.ChatCompletionTokenLogprob]:
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
        out = []
        for token, (logprob, top) in zip(token_ids, logprobs):
            entry = self._entry(token, logprob)
            out.append(P.ChatCompletionTokenLogprob(
                token=entry.token, logprob=entry.logprob, bytes=entry.bytes,
                top_logprobs=[self._entry(alt, alt_logprob) for alt, alt_logprob in top]))
        return out
