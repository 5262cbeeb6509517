"""What crosses the Qwen3-ASR graph's boundaries (see ``omni_serve.graph.messages``). One *window* of audio (a
whole clip, or one piece of a long one) is one request on the stages: the ingress opens a window's calls under its
own request id.

Calls (ingress -> stage): ``EncodeCall`` (encoder), ``TranscribeCall`` (llm: the window's prompt token ids, its
``<|audio_pad|>`` placeholders one per audio token, and the decoding settings).
Outputs (stage -> ingress): ``AudioEncoded`` (encoder: the window's audio tokens), ``TranscriptTokens`` (llm: the
tokens chosen since its last one: see ``LLMParams.stream_interval``), ``TranscribeDone`` (llm: counts and why it
stopped).
Edge payloads: ``AudioFeatures`` (ingress -> encoder: the window's own log-mel, as the processor makes it for that
window alone, and its valid frames), ``AudioEmbeds`` (encoder -> llm: ``[audio tokens, hidden]``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_serve.graph.messages import Message, Tensor


# -- calls ---------------------------------------------------------------------------------------------------
class EncodeCall(Message):
    request_id: str


class TranscribeCall(Message):
    request_id: str
    input_ids: list[int] = Field(min_length=1)  # the chat prompt, <|audio_pad|> expanded
    max_tokens: int = Field(ge=1)
    temperature: float = Field(0.0, ge=0)  # 0: greedy, as the reference decodes
    seed: int = 0  # of the sampler when temperature > 0
    stream: bool = True  # the text streams: tokens go out as they come (params.stream_interval), else all at the end


# -- outputs -------------------------------------------------------------------------------------------------
class AudioEncoded(Message):
    audio_tokens: int


class TranscriptTokens(Message):
    token_ids: list[int]


class TranscribeDone(Message):
    prompt_tokens: int
    generated_tokens: int
    finish_reason: Literal["stop", "length"]


# -- edge payloads -------------------------------------------------------------------------------------------
class AudioFeatures(Message):
    features: Tensor  # [mel bins, T] float32, T a multiple of 100 frames (zero-padded)
    frames: int = Field(ge=1)  # valid frames


class AudioEmbeds(Message):
    embeds: Tensor  # [audio tokens, LLM hidden] float32
