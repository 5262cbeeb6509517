"""The Qwen3-ASR bench's baseline: transformers' ``Qwen3ASRForConditionalGeneration.generate`` in this process, the
transcription bench's requests one at a time.

Contract: ``TransformersTranscriptionBaseline(checkpoint, threads, max_tokens, window_seconds, window_search_seconds)``
sets ``torch.set_num_threads(threads)`` (default: all cores) and loads the processor and the model from the local
directory (float32, eval). ``run(requests, warmup, progress_every)`` is an
``omni_serve.bench.transcription.TranscriptionBaseline``: ``warmup`` unmeasured requests, then per request what the
served graph does for it, in this process and in order: the uploaded WAV decoded by the server's own decoder
(``omni_serve.api.media.decode_audio_bytes``, 16 kHz mono), cut into the server's windows
(``omni_serve.families.qwen3_asr.prompting.split_windows``), and per window the processor's
``apply_transcription_request`` (the request's language and prompt) and greedy ``generate`` with ``max_new_tokens`` =
the served ``max_tokens``, the stop tokens dropped (the server does not send them). Each window's tokens go through
the server's transcript decoder (``prompting.TranscriptText``) as ``generate`` streams them (a
``transformers`` streamer), so TTFT is the first non-empty text, as the served stream's first
``transcript.text.delta`` is; the transcript is the windows' texts joined (``prompting.join``), as the server's
``transcript.text.done``. A record's E2E is all of it (``compute_s``: the ``generate`` calls alone); a failed request
is recorded, never raised. ``from_config(TranscriptionBenchConfig)`` is the baseline ``run_transcription_bench``
runs.
"""

from __future__ import annotations

import os
import time

from omni_serve.bench.client import progress_logger
from omni_serve.bench.transcription import (
    BASELINE_SYSTEM, SAMPLE_RATE, ClipRequest, TranscriptionRecord, TranscriptionRunResult,
)


class _FirstText:
    """A ``generate`` streamer: the new tokens of one window into the server's transcript decoder; the time of its
    first non-empty text."""

    def __init__(self, text, stops: set[int]):
        self.text, self.stops = text, stops
        self.prompt_seen = False
        self.first_text_t: float | None = None

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate's first call: the prompt
            self.prompt_seen = True
            return
        ids = [t for t in value.reshape(-1).tolist() if t not in self.stops]
        if ids and self.text.add(ids) and self.first_text_t is None:
            self.first_text_t = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersTranscriptionBaseline:
    """transformers' Qwen3-ASR in this process, requests one at a time, windows as the server cuts them."""

    def __init__(self, checkpoint: str, threads: int | None = None, max_tokens: int = 512,
                 window_seconds: float = 30.0, window_search_seconds: float = 5.0):
        import torch
        from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

        self.threads = threads or os.cpu_count() or 1
        torch.set_num_threads(self.threads)
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.model = Qwen3ASRForConditionalGeneration.from_pretrained(checkpoint).eval()
        eos = self.model.generation_config.eos_token_id
        self.stops = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.max_tokens, self.window_s, self.search_s = max_tokens, window_seconds, window_search_seconds

    def run_one(self, req: ClipRequest) -> TranscriptionRecord:
        import torch

        from omni_serve.api.media import decode_audio_bytes
        from omni_serve.families.qwen3_asr.prompting import TranscriptText, join, split_windows

        rec = TranscriptionRecord(index=req.index, audio_seconds=req.seconds)
        t0 = time.perf_counter()
        try:
            audio = decode_audio_bytes(req.wav, "wav", target_sr=SAMPLE_RATE, max_seconds=1e9, param="file")
            windows, texts, compute = [], [], 0.0
            for a, b in split_windows(audio.size, SAMPLE_RATE, self.window_s, self.search_s, audio):
                inputs = self.processor.apply_transcription_request(audio[a:b], language=req.language or None,
                                                                    prompt=req.prompt or None)
                text = TranscriptText(self.processor, forced=bool(req.language))
                streamer = _FirstText(text, self.stops)
                t_gen = time.perf_counter()
                with torch.inference_mode():
                    seq = self.model.generate(**inputs, max_new_tokens=self.max_tokens, do_sample=False,
                                              streamer=streamer)
                compute += time.perf_counter() - t_gen
                if rec.ttft_s is None and streamer.first_text_t is not None:
                    rec.ttft_s = streamer.first_text_t - t0
                windows.append([t for t in seq[0, inputs["input_ids"].shape[1]:].tolist() if t not in self.stops])
                texts.append(text.final()["transcription"])
            rec.text, rec.window_tokens, rec.compute_s = join(texts), windows, compute
            rec.text_chars = len(rec.text)
            rec.output_tokens, rec.token_source = sum(map(len, windows)), "generate"
            rec.ok = True
        except Exception as exc:  # noqa: BLE001 - a failed request is recorded, not fatal
            rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.e2e_s = time.perf_counter() - t0
        if rec.ok and rec.ttft_s is None:  # no text at all: the first text is the whole (empty) transcript
            rec.ttft_s = rec.e2e_s
        return rec

    def run(self, requests: list[ClipRequest], warmup: int = 1, progress_every: int = 10,
            label: str = BASELINE_SYSTEM) -> TranscriptionRunResult:
        for req in requests[:warmup]:
            self.run_one(req)
        on_done = progress_logger(label, len(requests), progress_every)
        records = []
        t_run = time.perf_counter()
        for req in requests:
            start = time.perf_counter() - t_run
            records.append(self.run_one(req))
            records[-1].start_s = start
            on_done(records[-1])
        wall = time.perf_counter() - t_run
        notes = [f"transformers {type(self.model).__name__}.generate in process, one request at a time, greedy, "
                 f"max_new_tokens {self.max_tokens}, {self.threads} torch threads, float32; E2E: the WAV decoded, "
                 "the server's windows, the processor's prompt and features and generate per window; TTFT: the "
                 "first non-empty text of the server's transcript decoder as generate streams"]
        return TranscriptionRunResult(label=label, system=BASELINE_SYSTEM, mode="transcription", concurrency=1,
                                      wall_s=wall, streaming=False, records=records, notes=notes)


def from_config(cfg) -> TransformersTranscriptionBaseline:
    return TransformersTranscriptionBaseline(cfg.checkpoint, cfg.threads, cfg.max_tokens, cfg.window_seconds,
                                             cfg.window_search_seconds)
