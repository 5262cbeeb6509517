"""Per-request token selection built from transformers' logits processors.

Contract: ``Sampler(params, vocab_size).select(logits, history) -> int``. A ``temperature`` below
``GREEDY_BELOW`` (0, or so small that logits divided by it overflow) is greedy; otherwise temperature,
top-k and top-p warpers then a draw from a per-request ``torch.Generator`` seeded with ``params.seed``
(reproducible per request, independent of other requests in the replica). Repetition penalty, suppressed
tokens and a minimum length apply in both modes, as in ``generate``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


# Temperatures below this sample greedily (as vLLM's _SAMPLING_EPS): the distribution is already a point
# mass to float precision, and logits / 1e-300 overflow to inf and NaN probabilities.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_BELOW


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int = 0
    suppress_tokens: tuple[int, ...] = ()
    min_new_tokens: int = 0  # stop_token_ids are suppressed until this many tokens were generated
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        p = params
        procs = []
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty))
        if p.min_new_tokens and p.stop_token_ids:
            procs.append(MinNewTokensLengthLogitsProcessor(0, p.min_new_tokens, list(p.stop_token_ids)))
        if p.suppress_tokens:
            procs.append(SuppressTokensLogitsProcessor(list(p.suppress_tokens)))
        if not p.greedy:
            if p.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(p.temperature))
            if p.top_k:
                procs.append(TopKLogitsWarper(top_k=p.top_k))
            if p.top_p < 1.0:
                procs.append(TopPLogitsWarper(top_p=p.top_p))
        self.processors = LogitsProcessorList(procs)
        self.generator = None if p.greedy else torch.Generator().manual_seed(p.seed)

    def select(self, logits: torch.Tensor, history: list[int]) -> int:
        scores = logits.view(1, -1).float()
        if len(self.processors):
            ids = torch.tensor([history], dtype=torch.long)
            scores = self.processors(ids, scores)
        if self.params.greedy:
            return int(scores.argmax(-1))
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
