"""Reading a streamed chat completion with the official ``openai`` client, the way OpenAI's documentation does.

With audio output, OpenAI streams the text as incremental ``delta.audio.transcript`` pieces (``content`` null) and
the audio as base64 pcm16 ``delta.audio.data`` pieces; a client concatenates each. Newer SDKs type
``delta.audio`` (``ChoiceDeltaAudio``); older ones hand it over as an extra field (a dict).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from types import SimpleNamespace


@dataclass
class Streamed:
    transcript: str = ""  # the delta.audio.transcript pieces, concatenated
    content: str = ""  # the delta.content pieces, concatenated
    pcm: bytes = b""  # the delta.audio.data pieces, decoded and concatenated
    usage: object = None
    finish_reason: str | None = None
    chunks: list = field(default_factory=list)


def read_stream(stream) -> Streamed:
    out = Streamed()
    transcript, content, pcm = [], [], []
    for chunk in stream:
        out.chunks.append(chunk)
        out.usage = chunk.usage or out.usage
        for c in chunk.choices:
            out.finish_reason = c.finish_reason or out.finish_reason
            if c.delta.content:
                content.append(c.delta.content)
            audio = getattr(c.delta, "audio", None)
            if isinstance(audio, dict):  # older SDKs: an untyped extra field
                audio = SimpleNamespace(transcript=audio.get("transcript"), data=audio.get("data"))
            if audio is not None and audio.transcript:
                transcript.append(audio.transcript)
            if audio is not None and audio.data:
                pcm.append(base64.b64decode(audio.data))
    out.transcript, out.content, out.pcm = "".join(transcript), "".join(content), b"".join(pcm)
    return out


def sse_has_text(line: str) -> bool:
    """Whether an SSE line is a chunk carrying text (``delta.content``, or ``delta.audio.transcript``)."""
    import json

    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return False
    choices = json.loads(line[5:]).get("choices") or [{}]
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content") or (delta.get("audio") or {}).get("transcript"))
