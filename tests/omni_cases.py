"""Prompts used by the Omni oracle tests: text only, with an audio clip, with an image."""

from __future__ import annotations

import io
import base64

import numpy as np


def audio_clip(seconds: float = 1.0, sr: int = 16000) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * sr)) / sr
    return (0.3 * np.sin(2 * np.pi * 220 * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def image(w: int = 80, h: int = 64):
    import PIL.Image

    rng = np.random.default_rng(1)
    return PIL.Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8))


def wav_b64(samples: np.ndarray, sr: int = 16000) -> str:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def png_data_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def template_messages(kind: str) -> tuple[list[dict], list, list]:
    """(messages for the chat template, audios, images) for a case."""
    if kind == "text":
        return [{"role": "user", "content": [{"type": "text", "text": "hello world cat"}]}], [], []
    if kind == "audio":
        return ([{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "what is this"}]}],
                [audio_clip()], [])
    if kind == "image":
        return ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}],
                [], [image()])
    raise ValueError(kind)


CASES = ("text", "audio", "image")
