"""A realtime session's input audio buffer (OpenAI's Realtime API, ``input_audio_buffer.*``): pcm16 at 24 kHz as the
client appends it, cut into turns by the client's commits or by server VAD.

Contract: ``InputAudioBuffer(max_ms, on_speech_started, on_speech_stopped)``; the session awaits its methods from
its event loop, one client event at a time:
- ``await configure(turn_detection)``: a ``ServerVad`` turns Silero VAD on (``omni_serve.api.vad``: its model loads
  off the loop), None turns it off; either way the buffer is emptied.
- ``await append(pcm, event_id)``: adds audio (``RealtimeProblem`` ``input_audio_buffer_full`` past ``max_ms``).
  With VAD on, speech heard in it calls ``await on_speech_started(item_id, ms)`` and, once it stopped,
  ``await on_speech_stopped(item_id, ms, audio)`` with the turn's audio (pcm16 bytes, from ``prefix_padding_ms``
  before the detected start to the detected end), taken out of the buffer. A turn as long as the buffer holds ends
  where the buffer is full, and listening goes on. Between turns only what a turn's prefix may take (plus 1 s) is
  kept, so an idle session's memory stays bounded. ``ms`` counts from the first audio since the last clear.
- ``commit(event_id) -> (item_id, audio)``: the whole buffer as one turn (the id of the speech VAD is hearing, if
  any), emptied (``RealtimeProblem`` ``input_audio_buffer_commit_empty`` under ``MIN_COMMIT_MS``).
- ``clear()``: empties the buffer and forgets any speech in progress.
``pcm16(data, param, event_id)`` decodes an event's base64 audio (``RealtimeProblem`` when it is not whole pcm16).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

from omni_serve.api import realtime_protocol as R

BYTES_PER_MS = R.PCM_RATE * 2 // 1000  # pcm16 mono at 24 kHz
MIN_COMMIT_MS = 100  # OpenAI's smallest committed buffer
# Silero runs here for every session's appends: its own threads, so VAD never queues behind preprocessing
_VAD_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="realtime-vad")


def pcm16(data: str, param: str, event_id: str | None) -> bytes:
    try:
        pcm = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise R.RealtimeProblem("Audio must be base64 pcm16 (24 kHz mono).", param=param, event_id=event_id) from None
    if len(pcm) % 2:
        raise R.RealtimeProblem("Audio must be whole pcm16 samples (an even number of bytes).", param=param,
                                event_id=event_id)
    return pcm


class InputAudioBuffer:
    def __init__(self, max_ms: float, on_speech_started: Callable[[str, int], Awaitable[None]],
                 on_speech_stopped: Callable[[str, int, bytes], Awaitable[None]]):
        self.max_ms = max_ms
        self.on_speech_started, self.on_speech_stopped = on_speech_started, on_speech_stopped
        self.buffer = bytearray()  # uncommitted input audio (pcm16, 24 kHz)
        self.buffer_ms = 0.0  # where the buffer starts on the input's timeline (ms since the last clear)
        self.vad: R.ServerVad | None = None
        self.detector = None  # SpeechDetector while server_vad is on
        self.speech: tuple[str, int] | None = None  # (item id, start ms) of the speech VAD is hearing

    @property
    def ms(self) -> float:
        """Audio in the buffer (ms)."""
        return len(self.buffer) / BYTES_PER_MS

    async def configure(self, turn_detection: R.ServerVad | None) -> None:
        self.vad = turn_detection
        if turn_detection is None:
            self.detector = None
        else:
            from omni_serve.api.vad import SpeechDetector

            # loading the model's JIT file takes tens of milliseconds: off the loop
            self.detector = await asyncio.to_thread(SpeechDetector, turn_detection.threshold,
                                                    turn_detection.silence_duration_ms)
        self.buffer.clear()
        self.buffer_ms, self.speech = 0.0, None

    async def append(self, pcm: bytes, event_id: str | None) -> None:
        if not pcm:
            return
        if self.detector is not None and self.speech is not None and self.ms + len(pcm) / BYTES_PER_MS > self.max_ms:
            # a turn as long as the buffer holds: it ends here (as if its speech stopped) and listening goes on
            await self._stopped(int(self.buffer_ms + self.ms))
            self.detector.reset()
            self.buffer_ms = 0.0
        if self.ms + len(pcm) / BYTES_PER_MS > self.max_ms:
            raise R.RealtimeProblem(f"The input audio buffer holds at most {self.max_ms / 1000:g} s "
                                    "(max_audio_seconds); commit or clear it.", code="input_audio_buffer_full",
                                    param="audio", event_id=event_id)
        self.buffer += pcm
        if self.detector is None:
            return
        loop = asyncio.get_running_loop()
        for kind, ms in await loop.run_in_executor(_VAD_THREADS, self.detector.feed, pcm):  # off the loop
            if kind == "start":
                self.speech = (R.new_id("item"), ms)
                await self.on_speech_started(self.speech[0], ms)
            else:
                await self._stopped(ms)
        if self.speech is None:  # no turn open: keep only what a turn's prefix padding may take (and 1 s more)
            keep = int((self.vad.prefix_padding_ms + 1000) * BYTES_PER_MS)
            drop = max(0, len(self.buffer) - keep) // 2 * 2
            del self.buffer[:drop]
            self.buffer_ms += drop / BYTES_PER_MS

    async def _stopped(self, ms: int) -> None:
        if self.speech is None:
            return
        item_id, start = self.speech
        begin = max(self.buffer_ms, start - self.vad.prefix_padding_ms)
        drop = int((begin - self.buffer_ms) * BYTES_PER_MS) // 2 * 2  # audio before the prefix: not the turn's
        del self.buffer[:drop]
        self.buffer_ms = begin
        audio = self._take(max(0, int((ms - begin) * BYTES_PER_MS)) // 2 * 2)
        await self.on_speech_stopped(item_id, ms, audio)

    def commit(self, event_id: str | None) -> tuple[str, bytes]:
        if self.ms < MIN_COMMIT_MS:
            raise R.RealtimeProblem(f"The input audio buffer holds {self.ms:.0f} ms; at least {MIN_COMMIT_MS} ms can "
                                    "be committed.", code="input_audio_buffer_commit_empty", event_id=event_id)
        item_id = self.speech[0] if self.speech else R.new_id("item")
        return item_id, self._take(len(self.buffer))

    def _take(self, nbytes: int) -> bytes:
        """The buffer's first ``nbytes``, taken out; no speech is open after it."""
        audio = bytes(self.buffer[:nbytes])
        del self.buffer[:nbytes]
        self.buffer_ms += nbytes / BYTES_PER_MS
        self.speech = None
        return audio

    def clear(self) -> None:
        self.buffer.clear()
        self.buffer_ms, self.speech = 0.0, None
        if self.detector is not None:
            self.detector.reset()
