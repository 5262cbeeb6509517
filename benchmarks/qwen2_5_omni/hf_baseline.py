"""In-process transformers baseline: the same workload through ``Qwen2_5OmniForConditionalGeneration.generate``
(``HFBaseline``; ``benchmarks.qwen3_omni.hf_baseline.Qwen3HFBaseline`` is the qwen3_omni graph's).

Contract: ``run_hf_baseline(requests, HFBaselineConfig(checkpoint=DIR), baseline=HFBaseline) -> RunResult``
(``system="hf"``, ``streaming=False``, ``concurrency=1``) runs the requests one at a time in this process, after
``warmup`` unmeasured requests. It loads the checkpoint from the local directory only (no network).
Each request is prepared exactly as the server's ingress prepares it: the graph's default system prompt
(or ``system_prompt``) then the user turn, through ``OmniInputProcessor`` (same chat template and
tokenizer). Generation settings mirror the server's for that request:

* thinker: ``max_new_tokens = request.max_tokens`` (``min_new_tokens = request.min_tokens`` when set),
  stops on ``<|im_end|>`` (the server's only stop token); greedy when ``temperature == 0``, else sampled
  with that temperature and ``top_p`` (no top-k, like the server's sampler).
* talker (audio requests): voice -> ``speaker``; ``max_new_tokens = max_codec_tokens`` and sampling
  temperature / top-k / top-p / repetition penalty from the graph spec defaults (``TalkerParams``);
  greedy when the request's temperature is 0 (the repetition penalty still applies), as the server does;
  stops on the codec pad / end ids.
* token2wav: ``num_steps`` / ``guidance_scale`` / ``sway_coefficient`` from ``Code2WavParams``.
* ``torch.manual_seed(request.seed)`` before each call. Sampled outputs still differ from the server's
  (different random streams); greedy ones match token for token.

Per request: E2E (input preparation + generate), output tokens (generated thinker ids, the stop token
included, as the server's usage counts them), audio seconds (waveform samples / 24000). TTFT = TTFP = E2E
because generate returns nothing before it finishes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, field

from omni_serve.bench.records import RequestRecord, RunResult
from omni_serve.bench.workload import BenchRequest

log = logging.getLogger(__name__)

SAMPLE_RATE = 24000


@dataclass
class ServerDefaults:
    """The graph-spec settings the baseline mirrors (defaults read from ``omni_serve.families.qwen2_5_omni.spec``)."""

    max_codec_tokens: int
    talker_temperature: float
    talker_top_k: int
    talker_top_p: float
    talker_repetition_penalty: float
    num_steps: int
    guidance_scale: float
    sway_coefficient: float

    @classmethod
    def from_spec(cls, **overrides) -> "ServerDefaults":
        from omni_serve.families.qwen2_5_omni.spec import Code2WavParams, TalkerParams

        t, c = TalkerParams(), Code2WavParams()
        values = dict(max_codec_tokens=t.max_codec_tokens, talker_temperature=t.temperature, talker_top_k=t.top_k,
                      talker_top_p=t.top_p, talker_repetition_penalty=t.repetition_penalty,
                      num_steps=c.num_steps, guidance_scale=c.guidance_scale, sway_coefficient=c.sway_coefficient)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass
class HFBaselineConfig:
    checkpoint: str
    max_codec_tokens: int | None = None  # None: the graph spec default (set it to the server's value)
    num_steps: int | None = None  # None: the graph spec default
    system_prompt: str | None = None  # None: the checkpoint family's default speech system prompt
    threads: int | None = None  # torch intra-op threads; None: all cores
    warmup: int = 1
    progress_every: int = 10
    extra_notes: list[str] = field(default_factory=list)


class HFBaseline:
    """The loaded reference model plus the server's input preparation."""

    model_class = "Qwen2_5OmniForConditionalGeneration"

    def __init__(self, cfg: HFBaselineConfig):
        import torch

        self.cfg = cfg
        self.threads = cfg.threads or os.cpu_count() or 1
        torch.set_num_threads(self.threads)
        self._load(cfg)
        self.im_end = self.inputs.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _load(self, cfg: HFBaselineConfig) -> None:
        """Set ``model``, ``inputs`` (the server's input processor), ``system_prompt``, ``voices`` (lower -> name)
        and the family's generation defaults."""
        import torch
        from transformers import Qwen2_5OmniForConditionalGeneration

        from omni_serve.families.qwen2_5_omni.spec import SPEECH_SYSTEM_PROMPT
        from omni_serve.models.qwen2_5_omni_inputs import OmniInputProcessor

        self.defaults = ServerDefaults.from_spec(max_codec_tokens=cfg.max_codec_tokens, num_steps=cfg.num_steps)
        self.system_prompt = cfg.system_prompt or SPEECH_SYSTEM_PROMPT
        self.inputs = OmniInputProcessor(cfg.checkpoint)
        self.model = Qwen2_5OmniForConditionalGeneration.from_pretrained(
            cfg.checkpoint, local_files_only=True, dtype=torch.float32).eval()
        tc = self.model.config.talker_config
        self.talker_stop_ids = [tc.tts_codec_pad_token_id, tc.tts_codec_end_token_id]
        self.voices = {name.lower(): name for name in self.model.speaker_map}

    def messages(self, req: BenchRequest) -> list[dict]:
        """What the ingress builds for a text request without a system message."""
        return [{"role": "system", "content": [{"type": "text", "text": self.system_prompt}]},
                {"role": "user", "content": [{"type": "text", "text": req.prompt}]}]

    def generate_kwargs(self, req: BenchRequest) -> dict:
        sample = req.temperature > 0
        kw = {"thinker_max_new_tokens": req.max_tokens, "thinker_eos_token_id": self.im_end,
              "thinker_do_sample": sample}
        if sample:
            kw.update(thinker_temperature=req.temperature, thinker_top_p=req.top_p or 1.0, thinker_top_k=0)
        if req.min_tokens:
            kw["thinker_min_new_tokens"] = req.min_tokens
        if not req.audio:
            kw["generation_mode"] = "text"
            return kw
        voice = self.voices.get(req.voice.lower())
        if voice is None:
            raise ValueError(f"unknown voice {req.voice!r}; the checkpoint has {sorted(self.voices.values())}")
        return kw | self.speech_kwargs(voice, sample)

    def speech_kwargs(self, voice: str, sample: bool) -> dict:
        """The talker / code2wav arguments of ``generate`` for a spoken answer, as the server sets them."""
        d = self.defaults
        kw = dict(speaker=voice, talker_max_new_tokens=d.max_codec_tokens, talker_do_sample=sample,
                  talker_repetition_penalty=d.talker_repetition_penalty, talker_eos_token_id=self.talker_stop_ids,
                  token2wav_num_steps=d.num_steps, token2wav_guidance_scale=d.guidance_scale,
                  token2wav_sway_coefficient=d.sway_coefficient)
        if sample:
            kw.update(talker_temperature=d.talker_temperature, talker_top_k=d.talker_top_k,
                      talker_top_p=d.talker_top_p)
        return kw

    def audio_notes(self) -> list[str]:
        d = self.defaults
        return [f"talker max_new_tokens={d.max_codec_tokens}, token2wav num_steps={d.num_steps}"]

    def run_one(self, req: BenchRequest) -> RequestRecord:
        import torch

        rec = RequestRecord(index=req.index)
        t0 = time.perf_counter()
        try:
            x = self.inputs(self.messages(req))
            kwargs = self.generate_kwargs(req)
            torch.manual_seed(req.seed)
            with torch.inference_mode():
                out = self.model.generate(**x.reference_kwargs(), **kwargs)
            seq, wav = (out if isinstance(out, tuple) else (out, None))
            seq = getattr(seq, "sequences", seq)
            gen = seq[0, x.input_ids.shape[1]:].tolist()
            rec.output_tokens, rec.token_source = len(gen), "generate"
            rec.finish_reason = "stop" if gen and gen[-1] == self.im_end else "length"
            text = self.inputs.tokenizer.decode([t for t in gen if t != self.im_end], skip_special_tokens=True)
            rec.text_chars = len(text)
            rec.text_sha1 = hashlib.sha1(text.encode("utf-8")).hexdigest()
            rec.audio_seconds = 0.0 if wav is None else int(wav.numel()) / SAMPLE_RATE
            rec.ok = True
        except Exception as exc:  # noqa: BLE001 - a failed request is recorded, not fatal
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.e2e_s = time.perf_counter() - t0
        if rec.ok:
            rec.ttft_s = rec.e2e_s
            rec.ttfp_s = rec.e2e_s if req.audio else None
        return rec

    def run(self, requests: list[BenchRequest], label: str = "hf") -> RunResult:
        from omni_serve.bench.client import progress_logger

        for req in requests[: self.cfg.warmup]:
            self.run_one(req)
        on_done = progress_logger(label, len(requests), self.cfg.progress_every)
        records = []
        t_run = time.perf_counter()
        for req in requests:
            start = time.perf_counter() - t_run
            rec = self.run_one(req)
            rec.start_s = start
            records.append(rec)
            on_done(rec)
        wall = time.perf_counter() - t_run
        notes = [f"transformers {self.model_class}.generate, one request at a time, "
                 f"{self.threads} torch threads; TTFT = TTFP = E2E (not streaming)"]
        if any(r.audio for r in requests):
            notes += self.audio_notes()
        notes += self.cfg.extra_notes
        if any(r.temperature > 0 for r in requests):
            notes.append("sampled requests (temperature > 0): same settings as the server but its own random "
                         "stream (torch.manual_seed(seed) before generate), so outputs may differ from the engine's")
        return RunResult(label=label, system="hf", mode="omni", concurrency=1, request_rate=None, wall_s=wall,
                         streaming=False, records=records, notes=notes)


def run_hf_baseline(requests: list[BenchRequest], cfg: HFBaselineConfig, label: str = "hf",
                    baseline: type[HFBaseline] = HFBaseline) -> RunResult:
    log.info("loading the transformers %s baseline from %s ...", baseline.model_class, cfg.checkpoint)
    return baseline(cfg).run(requests, label=label)
