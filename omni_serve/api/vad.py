"""Server voice activity detection for realtime sessions: Silero VAD (the ``silero-vad`` package, its weights in the
wheel) on the session's input audio as it arrives.

Contract: ``SpeechDetector(threshold, silence_duration_ms)`` is fed the input audio in any pieces
(``feed(pcm16)``: pcm16 mono at 24 kHz) and returns what happened in them, in order: ``("start", ms)`` when speech
starts and ``("stop", ms)`` when it has been followed by ``silence_duration_ms`` of silence, ``ms`` counted from
the first audio fed (the start is the first 32 ms window whose speech probability reaches ``threshold``; the stop
is the end of the last window of speech, as Silero's ``VADIterator`` reports them). ``reset()`` forgets the past
(a cleared buffer). The audio is resampled to 16 kHz (Silero's rate) by a stateful FIR filter (the same samples
whatever the pieces) and judged in windows of 512 samples (about 1.5 ms of one core each); each detector has its
own model state (a session's). ``feed`` is CPU work: a server calls it off its event loop.

Why Silero's iterator and not our own threshold: speech probability from a trained model is what separates speech
from noise, music and breathing; an energy threshold is not.
"""

from __future__ import annotations

import threading

import numpy as np

WINDOW = 512  # samples at 16 kHz per judgement (32 ms): the model's frame
_load_lock = threading.Lock()


def _load_model():
    from silero_vad import load_silero_vad

    with _load_lock:  # the JIT loader is not reentrant
        return load_silero_vad()


class _Resampler:
    """24 kHz -> 16 kHz as a stream: upsample by 2, one low-pass FIR with its state carried from piece to piece
    (``scipy.signal.lfilter``'s ``zi``), keep every third sample. Pieces of any size give the samples the whole
    signal would (resampling each piece alone would zero-pad its edges: a dip the VAD hears at every append)."""

    TAPS = 96

    def __init__(self):
        from scipy.signal import firwin

        self.h = (2 * firwin(self.TAPS, 1 / 3)).astype(np.float64)  # cut at 8 kHz of the 48 kHz upsampled rate
        self.reset()

    def reset(self) -> None:
        self.zi = np.zeros(self.TAPS - 1)
        self.count = 0  # upsampled samples so far: which of them are kept

    def __call__(self, x: np.ndarray) -> np.ndarray:
        from scipy.signal import lfilter

        if not len(x):
            return np.zeros(0, dtype=np.float32)
        up = np.zeros(2 * len(x))
        up[::2] = x
        y, self.zi = lfilter(self.h, 1.0, up, zi=self.zi)
        first = (-self.count) % 3
        self.count += len(up)
        return y[first::3].astype(np.float32)


class SpeechDetector:
    def __init__(self, threshold: float = 0.5, silence_duration_ms: int = 500):
        import torch
        from silero_vad import VADIterator

        self._torch = torch
        self.iterator = VADIterator(_load_model(), threshold=threshold, sampling_rate=16000,
                                    min_silence_duration_ms=silence_duration_ms, speech_pad_ms=0)
        self._pending = np.zeros(0, dtype=np.float32)  # 16 kHz samples not judged yet (less than a window)
        self._resample = _Resampler()

    @property
    def speaking(self) -> bool:
        return bool(self.iterator.triggered)

    def reset(self) -> None:
        self.iterator.reset_states()
        self._pending = np.zeros(0, dtype=np.float32)
        self._resample.reset()

    def feed(self, pcm16: bytes) -> list[tuple[str, int]]:
        x = np.frombuffer(pcm16, dtype="<i2").astype(np.float32) / 32768.0
        self._pending = np.concatenate([self._pending, self._resample(x)])
        events = []
        while len(self._pending) >= WINDOW:
            window, self._pending = self._pending[:WINDOW], self._pending[WINDOW:]
            with self._torch.no_grad():
                out = self.iterator(self._torch.from_numpy(window.copy()))
            if out:
                kind, at = ("start", out["start"]) if "start" in out else ("stop", out["end"])
                events.append((kind, int(at / 16)))  # samples at 16 kHz -> ms
        return events
