"""Token selection: ``Sampler.select`` and the batched ``select_rows`` give exactly the tokens of transformers'
logits processors applied one row at a time through ``LogitsProcessorList`` (what ``Sampler`` ran before it kept
the suppression mask and called its processors directly), greedy and seeded, call after call; and the Qwen3-Omni
code predictor's batched run (``Qwen3OmniTalker.run_followups``) draws exactly what the predictor's own forward and
a per-frame ``select`` draw."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, SuppressTokensLogitsProcessor

from omni_serve.engines.sampling import Sampler, SamplingParams, _Suppress, select_rows, token_logprobs

VOCAB = 512


class Reference:
    """The per-row selection ``Sampler`` replaces: the same processors, but transformers' ``SuppressTokens`` for
    suppression, run through transformers' ``LogitsProcessorList`` on one row with its history, and a generator
    of its own seeded alike."""

    def __init__(self, p: SamplingParams):
        procs = [SuppressTokensLogitsProcessor(list(p.suppress_tokens)) if isinstance(proc, _Suppress) else proc
                 for proc in Sampler(p).processors]
        self.params, self.processors = p, LogitsProcessorList(procs)
        self.generator = None if p.greedy else torch.Generator().manual_seed(p.seed)

    def select(self, logits: torch.Tensor, history: list[int]) -> int:
        scores = self.processors(torch.tensor([history], dtype=torch.long), logits.view(1, -1).float())
        if self.params.greedy:
            return int(scores.argmax(-1))
        return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self.generator))


SUPPRESS = tuple(range(VOCAB - 64, VOCAB))
KINDS = {
    "greedy": lambda seed: SamplingParams(temperature=0.0, seed=seed),
    "greedy_suppressed": lambda seed: SamplingParams(temperature=0.0, seed=seed, suppress_tokens=SUPPRESS),
    "seeded": lambda seed: SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=seed),
    "seeded_warm": lambda seed: SamplingParams(temperature=0.7, top_p=0.9, seed=seed, suppress_tokens=SUPPRESS),
    "penalised": lambda seed: SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.1, seed=seed),
}


def logits_stream(rows: int, calls: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, VOCAB, generator=g) * 3 for _ in range(calls)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_select_equals_the_processor_list_with_history(kind):
    params = KINDS[kind](7)
    params.min_new_tokens, params.stop_token_ids = 3, (5, 6)
    ours, ref = Sampler(params), Reference(params)
    history: list[int] = []
    for logits in logits_stream(1, 30, seed=1):
        token = ours.select(logits[0], history)
        assert token == ref.select(logits[0], history)
        history.append(token)


@pytest.mark.parametrize("mix", [["greedy"], ["greedy_suppressed"], ["seeded"], ["seeded_warm"],
                                 ["greedy", "seeded", "penalised", "seeded_warm", "greedy_suppressed"]])
def test_select_rows_equals_one_row_at_a_time(mix):
    rows = 16
    params = [KINDS[mix[i % len(mix)]](seed=100 + i) for i in range(rows)]
    ours, refs = [Sampler(p) for p in params], [Reference(p) for p in params]
    drawn = []
    for logits in logits_stream(rows, 12, seed=2):  # generators advance call after call
        got = select_rows(ours, logits)
        assert got == [r.select(logits[i], []) for i, r in enumerate(refs)]
        drawn.append(got)
    if any(not p.greedy for p in params):
        assert len({tuple(d) for d in drawn}) > 1  # the draws do depend on the logits and generators


def test_select_rows_batches_only_samplers_that_process_alike():
    a, b = Sampler(KINDS["seeded"](1)), Sampler(KINDS["seeded"](2))
    assert a.batch_key == b.batch_key  # the seed alone differs: one batch, two generators
    assert a.batch_key != Sampler(KINDS["seeded_warm"](1)).batch_key
    assert Sampler(KINDS["penalised"](1)).batch_key is None  # reads the history: row by row


@pytest.fixture(scope="module")
def talker(qwen3_omni_tiny_dir):
    from omni_serve.models.qwen3_omni import Qwen3OmniTalker

    return Qwen3OmniTalker(qwen3_omni_tiny_dir)


def predictor_reference(talker, frames):
    """The code predictor as transformers runs it: its model's forward over a DynamicCache, then ``lm_head[g]``,
    one ``select`` per frame and group."""
    from transformers import DynamicCache

    p = talker.predictor
    with torch.inference_mode():
        first = talker.embed_codes([f.code0 for f in frames])
        x = torch.stack([torch.stack([f.hidden for f in frames]), first], dim=1)
        cache, codes, total = DynamicCache(config=p.config), [[f.code0 for f in frames]], first.clone()
        for g in range(talker.num_code_groups - 1):
            out = p.model(inputs_embeds=x, past_key_values=cache, use_cache=True)
            logits = p.lm_head[g](out.last_hidden_state[:, -1]).float()
            drawn = [f.sampler.select(logits[i], []) for i, f in enumerate(frames)]
            codes.append(drawn)
            emb = p.model.get_input_embeddings()[g](torch.tensor(drawn))
            total, x = total + emb, emb.unsqueeze(1)
    return [([row[i] for row in codes], total[i]) for i in range(len(frames))]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "mixed"])
def test_code_predictor_batch_equals_its_model_forward(talker, kind):
    from omni_serve.models.qwen3_omni import CodeFrame

    rows, vocab = 6, talker.predictor.config.vocab_size
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(rows, talker.embedding_size, generator=g)
    code0 = torch.randint(0, vocab, (rows,), generator=g).tolist()

    def params(i):
        greedy = kind == "greedy" or (kind == "mixed" and i % 2)
        return SamplingParams(temperature=0.0 if greedy else 1.0, top_k=50, top_p=0.8, seed=i)

    ours = [Sampler(params(i)) for i in range(rows)]
    theirs = [Sampler(params(i)) for i in range(rows)]
    for _ in range(3):  # the samplers' generators carry over from frame to frame
        got = talker.run_followups([CodeFrame(hidden[i], code0[i], ours[i]) for i in range(rows)])
        want = predictor_reference(talker, [CodeFrame(hidden[i], code0[i], theirs[i]) for i in range(rows)])
        for frame, (codes, embedding) in zip(got, want):
            assert frame.codes == codes
            assert torch.equal(frame.embedding, embedding)


def test_presence_and_frequency_penalties_count_the_generated_tokens():
    """OpenAI's formula: logit - frequency x count - presence x (count > 0), over the history (the tokens generated so
    far), greedy and sampled alike; rows with penalties read their history, so they are selected one by one."""
    logits = torch.tensor([0.0, 1.0, 3.0, 2.2])
    plain = Sampler(SamplingParams(temperature=0.0))
    assert plain.select(logits, [2, 2]) == 2
    frequency = Sampler(SamplingParams(temperature=0.0, frequency_penalty=0.5))
    assert frequency.select(logits, [2]) == 2 and frequency.select(logits, [2, 2]) == 3  # 3.0 - 2 x 0.5 < 2.2
    presence = Sampler(SamplingParams(temperature=0.0, presence_penalty=0.9))
    assert presence.select(logits, [2]) == 3 and presence.select(logits, [1, 3]) == 2  # once is enough; 3 is 2.2-0.9
    scores = frequency.process(logits.view(1, -1), [[2, 2, 1]])
    assert scores[0].tolist() == pytest.approx([0.0, 0.5, 2.0, 2.2]) and frequency.batch_key is None
    assert Sampler(SamplingParams(temperature=0.0, presence_penalty=-2.0)).select(logits, [3]) == 3  # negative: favours


def test_token_logprobs_are_the_raw_log_softmax_and_its_top_k():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0], dtype=torch.bfloat16)
    want = torch.log_softmax(logits.float(), -1)
    chosen, top = token_logprobs(logits, 3, 2)
    assert chosen == pytest.approx(float(want[3]))
    assert [t for t, _ in top] == [1, 3] and [v for _, v in top] == pytest.approx([float(want[1]), float(want[3])])
    assert token_logprobs(logits, 2, 0) == (pytest.approx(float(want[2])), [])


def test_logit_bias_is_added_first_and_keeps_rows_batchable():
    """OpenAI's logit_bias adds its values to the raw logits (transformers' SequenceBiasLogitsProcessor, for one-token
    sequences, is the reference); it reads no history, so biased rows still batch in select_rows."""
    from transformers.generation.logits_process import SequenceBiasLogitsProcessor

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    bias = ((7, 100.0), (11, -3.5), (40, 0.25))
    sampler = Sampler(SamplingParams(temperature=0.0, logit_bias=bias))
    reference = SequenceBiasLogitsProcessor({(t,): v for t, v in bias})
    want = reference(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    torch.testing.assert_close(sampler.process(logits, None), want)
    assert sampler.batch_key is not None and not sampler.reads_history
    assert select_rows([sampler] * 3, logits) == [7, 7, 7]
    assert sampler.select(logits[0], []) == 7
