"""Ingress-side preparation of a Qwen3-ASR transcription: windows of long audio, each window's prompt and features
(the checkpoint's own processor), and the transcript's text as tokens arrive.

Contract:
- ``split_windows(n, rate, window_s, search_s, samples)`` -> ``[(start, end), ...]``: sample ranges covering
  ``[0, n)`` in order, none longer than ``window_s``. Audio up to ``window_s`` is one window. A longer one is cut,
  before each limit, at the quietest 100 ms of the last ``search_s`` seconds (lowest mean square), so a cut
  rarely splits a word. Why not a VAD model: the cut only needs a quiet moment near a limit, and a speech
  detector over the whole upload costs the ingress ~50 ms of CPU per second of audio (Silero at 16 kHz); the
  energy minimum costs a pass over the samples.
- ``WindowPrompts(checkpoint)``: ``window(samples, language, prompt)`` -> ``(input_ids, features [128, T], frames)``,
  what ``Qwen3ASRProcessor.apply_transcription_request`` gives the window alone (the prompt as the model was
  trained: ``prompt`` the system turn, a forced ``language`` prefilled as ``language <Name><asr_text>``; one
  ``<|audio_pad|>`` per audio token). A language the processor does not know (a name or ISO code, any case) is
  a ``ValueError``. ``decoder(forced)`` makes a ``TranscriptText`` on the checkpoint's tokenizer.
- ``TranscriptText``: ``add(token_ids) -> str`` gives the transcript's new text as tokens arrive (nothing until
  the model's ``language <Name><asr_text>`` prefix has passed when the language was not forced; whitespace at the
  end and an unfinished UTF-8 sequence are held back), ``flush()`` the rest once the window ended, ``final()`` the
  processor's parse of all tokens (``{"language", "transcription"}``, with its repetition fix). Without a
  repetition to fix, the deltas and the flush join to ``final()["transcription"]``.
- ``join(parts)``: window texts joined, with a space between two parts unless one side is CJK text.
"""

from __future__ import annotations

import unicodedata

import numpy as np

MARKER = "<asr_text>"


def split_windows(n: int, rate: int, window_s: float, search_s: float, samples: np.ndarray | None = None,
                  ) -> list[tuple[int, int]]:
    window, search, frame = int(window_s * rate), int(search_s * rate), max(1, rate // 10)
    out, start = [], 0
    while n - start > window:
        limit = start + window
        cut = limit
        if samples is not None and search >= frame:
            region = samples[limit - search:limit].astype(np.float64)
            frames = len(region) // frame
            energy = (region[:frames * frame].reshape(frames, frame) ** 2).mean(axis=1)
            # the middle of the quietest 100 ms (the latest of equals)
            cut = limit - search + (frames - 1 - int(np.argmin(energy[::-1]))) * frame + frame // 2
            cut = max(cut, start + frame)
        out.append((start, cut))
        start = cut
    out.append((start, n))
    return out


def _is_cjk(char: str) -> bool:
    return unicodedata.east_asian_width(char) in ("W", "F")


def join(parts: list[str]) -> str:
    text = ""
    for part in parts:
        if part:
            text += joiner(text, part) + part
    return text


def joiner(before: str, after: str) -> str:
    """What goes between window texts ``before`` and ``after``."""
    if not before or not after or _is_cjk(before[-1]) or _is_cjk(after[0]):
        return ""
    return " "


class WindowPrompts:
    def __init__(self, checkpoint: str):
        import torch
        from transformers import AutoProcessor

        # the feature extractor's STFT runs on torch: one thread per call, as the ingress extracts the windows of
        # many requests at once (two threads a call only contend: 15 ms a window instead of 6 beside other work)
        torch.set_num_threads(1)

        self.processor = AutoProcessor.from_pretrained(checkpoint)
        self.sampling_rate = self.processor.feature_extractor.sampling_rate
        self.tokenizer = self.processor.tokenizer

    def window(self, samples: np.ndarray, language: str | None, prompt: str | None):
        inputs = self.processor.apply_transcription_request(samples, language=language or None,
                                                            prompt=prompt or None)
        frames = int(inputs["input_features_mask"][0].sum())
        return inputs["input_ids"][0].tolist(), inputs["input_features"][0].float(), frames

    def check_language(self, language: str | None) -> None:
        """Raises ``ValueError`` unless the processor knows ``language`` (a name or an ISO code)."""
        if language:
            from transformers.audio_utils import prepare_language_inputs
            from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

            prepare_language_inputs(language, 1, LANGUAGE_CODE_TO_NAME, return_code=False)

    def decoder(self, forced: bool) -> "TranscriptText":
        return TranscriptText(self.processor, forced)


class TranscriptText:
    def __init__(self, processor, forced: bool):
        self.processor, self.forced = processor, forced
        self.tokens: list[int] = []
        self.sent = 0  # characters of the view already given out

    def _view(self) -> str:
        text = self.processor.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if not self.forced:
            if MARKER not in text:
                return ""
            text = text.split(MARKER, 1)[1]
        return text.lstrip()

    def add(self, token_ids: list[int]) -> str:
        self.tokens.extend(token_ids)
        view = self._view().rstrip()
        while view.endswith("\ufffd"):  # a character whose bytes have not all arrived
            view = view[:-1]
        if len(view) <= self.sent:
            return ""
        delta, self.sent = view[self.sent:], len(view)
        return delta

    def flush(self) -> str:
        """The text still to give out once every token arrived: what joins the deltas to ``final()``'s
        transcription (all of it when the model never wrote the ``<asr_text>`` marker, which the parse then reads
        as a transcript without a language); "" when the deltas already went past it (a repetition fix)."""
        text = self.final()["transcription"]
        given = self._view().rstrip()[:self.sent]
        self.sent = 1 << 62  # the window is over: nothing more is given out
        return text[len(given):] if text.startswith(given) else ""

    def final(self) -> dict:
        text = self.processor.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if self.forced:
            text = MARKER + text  # parsed as the transcription, language unknown
        return self.processor.parse_output(text)
