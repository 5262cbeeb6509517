"""A speech reply's two streamed shapes, for any graph that speaks (``/v1/audio/speech``).

Contract:
- ``resumed(first, rest, on_error)``: a file's bytes, ``first`` (read ahead by the caller, so that an error before
  any audio is an ordinary error response) then the rest. A failure after the first bytes cannot be reported in a
  file: ``on_error(err)`` is told and the (truncated) file ends.
- ``speech_events(chunks, on_error, usage)``: server-sent events, ``speech.audio.delta`` per chunk of the file's bytes
  (base64), then ``speech.audio.done`` with ``usage()`` (read once the audio ended); a failure becomes an error
  event (``on_error(err)`` is told) and ends the stream.
"""

from __future__ import annotations

import base64
from typing import AsyncIterator, Callable

from omni_serve.api.audio_protocol import SpeechAudioDelta, SpeechAudioDone, SpeechUsage
from omni_serve.api.errors import OpenAIError
from omni_serve.api.sse import sse_error, sse_event


async def resumed(first: bytes, rest: AsyncIterator[bytes],
                  on_error: Callable[[OpenAIError], None]) -> AsyncIterator[bytes]:
    if first:
        yield first
    try:
        async for data in rest:
            yield data
    except OpenAIError as err:
        on_error(err)


async def speech_events(chunks: AsyncIterator[bytes], on_error: Callable[[OpenAIError], None],
                        usage: Callable[[], SpeechUsage]) -> AsyncIterator[str]:
    try:
        async for data in chunks:
            yield sse_event(SpeechAudioDelta(audio=base64.b64encode(data).decode()))
    except OpenAIError as err:
        on_error(err)
        yield sse_error(err)
        return
    yield sse_event(SpeechAudioDone(usage=usage()))
