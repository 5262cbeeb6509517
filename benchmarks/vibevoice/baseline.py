"""The hf speech baseline of the vibevoice bench (``--mode speech``): transformers'
``VibeVoiceForConditionalGeneration.generate`` speaks the bench's texts one at a time in this process, as the served
graph would: the same script (``parse_script``: a plain text is one turn of speaker 0), the same preset voice clip
(the checkpoint's ``voices/`` file, decoded to 24 kHz as the ingress decodes it), ``torch.manual_seed(seed)`` before
``generate`` with the seed the bench sent (``cfg.seed`` + the text's index) and ``max_new_tokens`` =
``ceil(max_speech_seconds * 7.5)``, the served graph's bound; the checkpoint's generation config otherwise (10
diffusion steps, CFG 1.3). Each request's time counts the processor (template, voice features) and ``generate``;
``generate`` returns the audio when it is done, so its first audio is its last (TTFP = E2E). One unmeasured
warm-up call first (the first ``generate`` imports diffusers and sets up lazily), as the engine side has its warm-up
requests.

Contract: ``run_baseline(cfg, texts) -> SpeechPoint`` (``system="hf"``, concurrency 1), what
``omni_serve.bench.speech.run_speech_bench`` calls; ``preset_clip(checkpoint, voice)`` and
``max_new_tokens(max_speech_seconds)`` are the served graph's voice and bound; ``inputs(processor, text, clip)``
the processor's inputs of one request.
"""

from __future__ import annotations

import logging
import math
import os
import time

import numpy as np

from omni_serve.bench.speech import SAMPLE_RATE, SpeechBenchConfig, SpeechPoint, SpeechRecord

log = logging.getLogger(__name__)
HOP = 3200  # samples per speech token (7.5 a second)
AUDIO_FILES = (".wav", ".flac", ".mp3", ".ogg")
DEFAULT_MAX_SPEECH_SECONDS = 120.0  # the graph spec's default


def max_new_tokens(max_speech_seconds: float | None) -> int:
    """The served graph's bound on a request's speech tokens (the frontend's ``SpeakCall.max_new_tokens``)."""
    return math.ceil((max_speech_seconds or DEFAULT_MAX_SPEECH_SECONDS) * SAMPLE_RATE / HOP)


def preset_clip(checkpoint: str, voice: str, voices_dir: str | None = None) -> np.ndarray:
    """The preset ``voice`` (a file of ``voices_dir``, default the checkpoint's ``voices/``, matched
    case-insensitively) at 24 kHz, decoded as the ingress decodes its presets."""
    from omni_serve.api.media import decode_audio_bytes

    folder = voices_dir or os.path.join(checkpoint, "voices")
    names = {os.path.splitext(e)[0].lower(): e for e in sorted(os.listdir(folder)) if
             os.path.splitext(e)[1].lower() in AUDIO_FILES} if os.path.isdir(folder) else {}
    if voice.lower() not in names:
        raise ValueError(f"no preset voice {voice!r} in {folder} (presets: {', '.join(names) or 'none'})")
    with open(os.path.join(folder, names[voice.lower()]), "rb") as f:
        return decode_audio_bytes(f.read(), "wav, mp3, flac or ogg", target_sr=SAMPLE_RATE, max_seconds=3600.0,
                                  param="voice")


def inputs(processor, text: str, clip: np.ndarray) -> dict:
    """The processor's inputs for ``text`` spoken in ``clip`` (one speaker), as the ingress builds the prompt."""
    from omni_serve.models.vibevoice_prompt import parse_script

    seen, messages = set(), []
    for speaker, line in parse_script(text):
        content = [{"type": "text", "text": line}]
        if speaker not in seen:
            seen.add(speaker)
            content.append({"type": "audio", "audio": clip})
        messages.append({"role": speaker, "content": content})
    return processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                         processor_kwargs={"sampling_rate": SAMPLE_RATE})


def run_baseline(cfg: SpeechBenchConfig, texts: list[str]) -> SpeechPoint:
    import torch
    from transformers import AutoProcessor, VibeVoiceForConditionalGeneration

    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    processor = AutoProcessor.from_pretrained(cfg.checkpoint)
    model = VibeVoiceForConditionalGeneration.from_pretrained(cfg.checkpoint).eval()
    clip = preset_clip(cfg.checkpoint, cfg.default_voice())
    tokens = max_new_tokens(cfg.max_speech_seconds)
    texts = texts[:cfg.baseline_requests] if cfg.baseline_requests else texts
    log.info("hf: %d texts, voice %s, %d speech tokens at most, %d torch threads", len(texts), cfg.default_voice(),
             tokens, torch.get_num_threads())
    with torch.no_grad():
        torch.manual_seed(cfg.seed)
        model.generate(**inputs(processor, texts[0], clip), max_new_tokens=2)  # warm-up, not timed
    records = []
    t_all = time.perf_counter()
    for i, text in enumerate(texts):
        t0 = time.perf_counter()
        with torch.no_grad():
            x = inputs(processor, text, clip)
            torch.manual_seed(cfg.seed + i)  # the seed the bench sent with this text
            audio = model.generate(**x, max_new_tokens=tokens)[0][0]
        e2e = time.perf_counter() - t0
        records.append(SpeechRecord(ok=audio.numel() > 0, ttfp_s=e2e, e2e_s=e2e, audio_s=audio.numel() / SAMPLE_RATE,
                                    status=200))
    point = SpeechPoint("hf", 1, time.perf_counter() - t_all, records, client_buffer_s=cfg.client_buffer_s)
    log.info("hf: %s", point.summary())
    return point
