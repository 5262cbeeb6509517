"""The hf speech baseline of the Omni benches (``--mode speech``): the family's transformers ``generate`` speaks the
bench's texts one at a time in this process, its thinker forced to the text in one forward (``ForcedThinker``: the
most favourable way to drive transformers, which has no speech API) and its talker greedy, with the talker's limits
of the served graph.

Contract: ``run_baseline(cfg, texts) -> SpeechPoint`` (``system="hf"``, concurrency 1) for ``cfg.graph``
``qwen2_5_omni`` or ``qwen3_omni`` (what ``omni_serve.bench.speech.run_speech_bench`` calls).
"""

from __future__ import annotations

import logging
import os
import time
from types import SimpleNamespace

from omni_serve.bench.speech import SAMPLE_RATE, SpeechBenchConfig, SpeechPoint, SpeechRecord

log = logging.getLogger(__name__)


class ForcedThinker:
    """Replaces a transformers Omni model's ``thinker.generate`` with one forward over the prompt and the forced
    reply (its last token excluded: generation never feeds it back), shaped as generate's output (``sequences``,
    per-step ``hidden_states``), so the model's own ``generate`` drives its talker and vocoder from those states."""

    def __init__(self, model, forced: list[int]):
        self.model, self.forced = model, forced

    def __enter__(self):
        import torch

        thinker, forced = self.model.thinker, self.forced

        def generate(input_ids, **kwargs):
            seq = torch.cat([input_ids, torch.tensor([forced])], dim=1)
            with torch.no_grad():
                out = thinker(input_ids=seq[:, :-1], attention_mask=torch.ones_like(seq[:, :-1]),
                              output_hidden_states=True)
            n = input_ids.shape[1]
            steps = [tuple(h[:, :n] for h in out.hidden_states)]
            steps += [tuple(h[:, n + k:n + k + 1] for h in out.hidden_states) for k in range(len(forced) - 1)]
            return SimpleNamespace(sequences=seq, hidden_states=tuple(steps))

        thinker.generate = generate
        return self

    def __exit__(self, *exc):
        del self.model.thinker.generate


def run_baseline(cfg: SpeechBenchConfig, texts: list[str]) -> SpeechPoint:
    import torch

    from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor

    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    if cfg.graph == "qwen2_5_omni":
        from transformers import Qwen2_5OmniForConditionalGeneration as Model

        from omni_serve.families.qwen2_5_omni.spec import SPEECH_SYSTEM_PROMPT as system
        extra = {"token2wav_num_steps": cfg.num_steps, "speaker": cfg.default_voice()}
    else:
        from transformers import Qwen3OmniMoeForConditionalGeneration as Model

        from omni_serve.families.qwen3_omni.spec import SPEECH_SYSTEM_PROMPT as system
        extra = {"speaker": cfg.default_voice().lower()}
    model = Model.from_pretrained(cfg.checkpoint).eval()
    proc = OmniInputProcessor(cfg.checkpoint)
    im_end = proc.tokenizer.convert_tokens_to_ids("<|im_end|>")
    texts = texts[:cfg.baseline_requests] if cfg.baseline_requests else texts
    records = []
    t_all = time.perf_counter()
    for text in texts:
        t0 = time.perf_counter()
        turns = [{"role": "system", "content": [{"type": "text", "text": system}]},
                 {"role": "user", "content": [{"type": "text", "text": text}]}]
        x = proc(turns, [], [])
        forced = proc.tokenizer.encode(text, add_special_tokens=False) + [im_end]
        with ForcedThinker(model, forced), torch.no_grad():
            _, wav = model.generate(**x.reference_kwargs(), talker_do_sample=False,
                                    talker_max_new_tokens=cfg.max_codec_tokens, **extra)
        e2e = time.perf_counter() - t0
        # transformers returns the whole waveform at the end: its first audio is its last
        records.append(SpeechRecord(ok=True, ttfp_s=e2e, e2e_s=e2e, audio_s=wav.numel() / SAMPLE_RATE))
    point = SpeechPoint("hf", 1, time.perf_counter() - t_all, records)
    log.info("hf: %s", point.summary())
    return point
