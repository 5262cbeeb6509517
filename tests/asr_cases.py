"""Audio and the reference of the Qwen3-ASR graph's tests (in process and served): seeded clips, and transformers'
greedy ``generate`` on each window of a clip (the processor's prompt for that window alone, the graph's own
window split)."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf
import torch

from omni_serve.families.qwen3_asr.prompting import split_windows

SR = 16000
MAX_TOKENS = 12
WINDOW_S, SEARCH_S = 3.0, 1.0
ARGS = {"max_tokens": MAX_TOKENS, "window_seconds": WINDOW_S, "window_search_seconds": SEARCH_S}


def tone(seconds: float, freq: float, seed: int) -> np.ndarray:
    """A seeded 16 kHz clip: two tones and a little noise."""
    t = np.arange(int(seconds * SR)) / SR
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.2 * np.sin(2 * np.pi * 3.7 * freq * t) + 0.05 * noise).astype(
        np.float32)


def speechy(seconds: float, seed: int) -> np.ndarray:
    """Tones with silent gaps (where a long clip's windows can be cut)."""
    x = tone(seconds, 200.0 + 50 * seed, seed)
    t = np.arange(x.size) / SR
    return (x * (np.sin(2 * np.pi * 0.7 * t) > -0.3)).astype(np.float32)


CLIPS = [tone(2.0, 220.0, 0), tone(1.3, 660.0, 1), tone(0.2, 300.0, 2), speechy(7.5, 3)]


def wav(samples: np.ndarray, rate: int = SR) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV", subtype="FLOAT")
    return buf.getvalue()


class Reference:
    """transformers' ``Qwen3ASRForConditionalGeneration`` on a checkpoint: ``tokens(samples, language, prompt)`` is
    its greedy tokens for each window of ``samples`` (at most ``MAX_TOKENS``, the stop token dropped)."""

    def __init__(self, checkpoint: str):
        from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.model = Qwen3ASRForConditionalGeneration.from_pretrained(checkpoint).eval()
        self.stops = set(self.model.generation_config.eos_token_id)

    def tokens(self, samples: np.ndarray, language=None, prompt=None) -> list[list[int]]:
        out = []
        for a, b in split_windows(samples.size, SR, WINDOW_S, SEARCH_S, samples):
            inputs = self.processor.apply_transcription_request(samples[a:b], language=language, prompt=prompt)
            with torch.no_grad():
                seq = self.model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
            out.append([t for t in seq[0, inputs["input_ids"].shape[1]:].tolist() if t not in self.stops])
        return out
