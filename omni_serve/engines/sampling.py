"""Per-request token selection built from transformers' logits processors.

Contract: ``Sampler(params).select(logits, history) -> int``. A ``temperature`` below ``GREEDY_BELOW`` (0, or
so small that logits divided by it overflow) is greedy; otherwise temperature, top-k and top-p warpers then a
draw from a per-request ``torch.Generator`` seeded with ``params.seed`` (reproducible per request, independent of
other requests in the replica). Repetition penalty, OpenAI's presence and frequency penalties, suppressed tokens and
a minimum length apply in both modes, as in ``generate``; so does ``logit_bias``.

``token_logprobs(logits, token, top)`` is a token's log-probability and the most likely alternatives, what
OpenAI's ``logprobs``/``top_logprobs`` return.

``select_rows(samplers, logits)`` is ``[s.select(logits[i], []) for i, s in enumerate(samplers)]`` in fewer
calls, for rows drawn without a history (the Qwen3-Omni code predictor's residual codebooks): rows whose samplers
share their processors are processed as one ``[n, V]`` batch (the processors and the softmax work row by row, so
every row's scores are those of its own call), greedy rows take one ``argmax``, and each sampled row still draws
from its own generator, in row order. Rows whose processors read the history (repetition, presence and frequency
penalties, minimum length) are selected one by one.

The processors are transformers' own, called in ``generate``'s order, except three. ``_LogitBias`` adds OpenAI's
``logit_bias`` first (transformers' ``SequenceBiasLogitsProcessor`` does the same for one-token sequences but
reads the history on every call, which would keep biased rows out of ``select_rows``' batches). transformers has
no presence or frequency penalty: ``_OccurrencePenalties`` applies them as OpenAI defines them and vLLM computes
them (a token's logit less ``frequency_penalty`` times its count in the tokens generated so far, less
``presence_penalty`` once it occurred; the prompt does not count), before the warpers. And suppression:
``SuppressTokens`` rebuilds its vocabulary mask (``isin`` over every suppressed id) on every call, so
``_Suppress`` keeps that mask and applies the same ``torch.where``.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace
from typing import Sequence

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias
    seed: int = 0
    suppress_tokens: tuple[int, ...] = ()
    min_new_tokens: int = 0  # stop_token_ids are suppressed until this many tokens were generated
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)


class _Suppress:
    """transformers' ``SuppressTokensLogitsProcessor`` with its vocabulary mask built once per vocabulary size."""

    def __init__(self, tokens: tuple[int, ...]):
        self.tokens = torch.tensor(list(tokens))
        self._masks: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        key = (scores.shape[-1], scores.device)
        mask = self._masks.get(key)
        if mask is None:
            vocab = torch.arange(key[0], device=scores.device)
            mask = self._masks[key] = torch.isin(vocab, self.tokens.to(scores.device))
        return torch.where(mask, -float("inf"), scores)


class _LogitBias:
    """OpenAI's ``logit_bias``: fixed values added to some tokens' logits (vLLM adds them before its penalties too);
    the bias vector is built once per vocabulary size."""

    def __init__(self, bias: tuple[tuple[int, float], ...]):
        self.ids = torch.tensor([t for t, _ in bias], dtype=torch.long)
        self.values = torch.tensor([v for _, v in bias], dtype=torch.float32)
        self._vectors: dict[tuple[int, torch.device], torch.Tensor] = {}

    def __call__(self, input_ids, scores: torch.Tensor) -> torch.Tensor:
        key = (scores.shape[-1], scores.device)
        vector = self._vectors.get(key)
        if vector is None:
            vector = torch.zeros(key[0], dtype=torch.float32, device=scores.device)
            vector[self.ids.to(scores.device)] = self.values.to(scores.device)
            self._vectors[key] = vector
        return scores + vector.to(scores.dtype)


class _OccurrencePenalties:
    """OpenAI's presence and frequency penalties over the tokens generated so far (see the module's docstring)."""

    def __init__(self, presence: float, frequency: float):
        self.presence, self.frequency = presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores).scatter_add_(1, input_ids, torch.ones_like(input_ids, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        p = params
        procs = []
        if p.logit_bias:
            procs.append(_LogitBias(p.logit_bias))
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(penalty=p.repetition_penalty))
        if p.presence_penalty or p.frequency_penalty:
            procs.append(_OccurrencePenalties(p.presence_penalty, p.frequency_penalty))
        if p.min_new_tokens and p.stop_token_ids:
            procs.append(MinNewTokensLengthLogitsProcessor(0, p.min_new_tokens, list(p.stop_token_ids)))
        self.reads_history = any(not isinstance(proc, _LogitBias) for proc in procs)  # read the tokens so far
        if p.suppress_tokens:
            procs.append(_Suppress(p.suppress_tokens))
        if not p.greedy:
            if p.temperature != 1.0:
                procs.append(TemperatureLogitsWarper(p.temperature))
            if p.top_k:
                procs.append(TopKLogitsWarper(top_k=p.top_k))
            if p.top_p < 1.0:
                procs.append(TopPLogitsWarper(top_p=p.top_p))
        # every processor takes (input_ids, scores) only: called directly, without LogitsProcessorList's
        # per-call signature inspection
        self.processors = procs
        self.generator = None if p.greedy else torch.Generator().manual_seed(p.seed)
        # samplers with equal keys process their rows identically (see select_rows); None: not batchable
        self.batch_key = None if self.reads_history else astuple(replace(p, seed=0))

    def process(self, scores: torch.Tensor, history: list[list[int]] | None) -> torch.Tensor:
        """``scores [n, V]`` (float) through the processors; ``history``: per row, the tokens generated so far
        (only read when ``reads_history``)."""
        ids = torch.tensor(history, dtype=torch.long, device=scores.device) if self.reads_history else None
        for proc in self.processors:
            scores = proc(ids, scores)
        return scores

    def select(self, logits: torch.Tensor, history: list[int]) -> int:
        scores = self.process(logits.view(1, -1).float(), [history])
        if self.params.greedy:
            return int(scores.argmax(-1))
        probs = torch.softmax(scores, dim=-1).cpu()  # the request's generator is a host one, on every device
        return int(torch.multinomial(probs, 1, generator=self.generator))


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """``token``'s log-probability under ``logits`` (raw: no processor applied, as vLLM's default
    ``raw_logprobs``) and the ``top`` most likely (token, log-probability) pairs, most likely first."""
    logprobs = torch.log_softmax(logits.view(-1).float(), dim=-1)
    best = logprobs.topk(top) if top else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return float(logprobs[token]), pairs


def select_rows(samplers: Sequence[Sampler], logits: torch.Tensor) -> list[int]:
    """One token per row of ``logits [n, V]``, row ``i`` by ``samplers[i]`` with an empty history: what
    ``samplers[i].select(logits[i], [])`` returns, batched where the samplers allow (see the module doc)."""
    out: list[int | None] = [None] * len(samplers)
    groups: dict[object, list[int]] = {}
    for i, s in enumerate(samplers):
        if s.batch_key is None:
            out[i] = s.select(logits[i], [])
        else:
            groups.setdefault(s.batch_key, []).append(i)
    for rows in groups.values():
        lead = samplers[rows[0]]
        scores = logits.float() if len(rows) == len(samplers) else logits[torch.tensor(rows)].float()
        scores = lead.process(scores, None)
        if lead.params.greedy:
            for i, token in zip(rows, scores.argmax(-1).tolist()):
                out[i] = token
            continue
        probs = torch.softmax(scores, dim=-1).cpu()
        for j, i in enumerate(rows):
            out[i] = int(torch.multinomial(probs[j:j + 1], 1, generator=samplers[i].generator))
    return out
