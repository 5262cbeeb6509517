"""What crosses the Qwen2.5-Omni graph's boundaries (see ``omni_serve.graph.messages``).

The calls, the thinker's outputs and the media/hand-off payloads are the Omni kit's
(``omni_serve.kits.omni.messages``, re-exported here); the talker side is this family's:
- ``TalkerCall`` (talker) and ``CodecDelta`` (talker output: the codec ids drawn);
- ``thinker_talker`` (stream): ``ThinkerStates``; the first chunk has ``head`` (``TalkerHead``: ``prompt``
  [L, H], thinker input embeddings with media positions zeroed plus last hidden states; ``bos``/``eos``/``pad``
  [H], thinker embeddings of the voice's text-bos, tts end and tts pad tokens; ``first_token``), every chunk has
  ``states`` ([k, H]: hidden + embedding of each generated token the thinker fed back);
- ``talker_code2wav`` (stream): ``CodecChunk``, codec token ids.
"""

from __future__ import annotations

from pydantic import Field

from omni_serve.graph.messages import Message, StreamChunk, Tensor
from omni_serve.kits.omni.messages import (  # noqa: F401 - the shared messages, importable from here
    AudioDelta, Code2WavCall, EncoderCall, MediaEmbeddings, MediaInputs, MediaLayout, PrefillDone, PromptHandoff,
    RawMedia, SamplingSettings, TalkerPrompt, TextDelta, ThinkerCall, TokenLogprob,
)


class TalkerCall(Message):
    request_id: str
    seed: int
    temperature: float = Field(ge=0)  # the request's; a greedy request decodes codes greedily too
    paced: bool = False  # its client plays the audio as it comes: the talker keeps playback.talker_lead_s ahead


class CodecDelta(Message):
    codes: list[int]


class TalkerHead(Message):
    prompt: Tensor
    bos: Tensor
    eos: Tensor
    pad: Tensor
    first_token: int


class ThinkerStates(StreamChunk):
    states: Tensor | None = None
    head: TalkerHead | None = None  # first chunk only


class CodecChunk(StreamChunk):
    codes: list[int]
    # The talker's rate for this stream so far: codes per second since its first code (None before a second code).
    # Code2wav sizes a stream's first audio chunk by it (a talker barely faster than real time needs a longer one).
    codes_per_s: float | None = None
