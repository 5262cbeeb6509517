"""What crosses the Qwen2.5-Omni graph's boundaries (see ``omni_serve.graphs.messages``).

Calls (ingress -> stage): ``EncoderCall``, ``ThinkerCall`` (every thinker stage of the layout gets the same one),
``TalkerCall``, ``Code2WavCall``.
Outputs (stage -> ingress): ``TextDelta`` (the text stage: ``thinker`` or ``thinker_decode``), ``PrefillDone``
(``thinker_prefill``), ``CodecDelta`` (talker), ``AudioDelta`` (code2wav: float32 samples).
Edge payloads (one per request unless streamed):
- ``ingress_encoder``: ``MediaInputs``, the processor's audio features and image patches;
- ``encoder_thinker``: ``MediaEmbeddings``, ``audio`` [n_a, H] and ``image`` [n_i, H] (present per media);
- ``ingress_thinker`` (thinker on vLLM): ``RawMedia``, the decoded clips (``audio`` [sum of samples] float32 at
  16 kHz, ``audio_lengths``) and images (``images`` [sum of h*w*3] uint8 RGB, ``image_sizes`` [[h, w], ...]), in
  prompt order;
- ``thinker_prefill_thinker_decode``: ``PromptHandoff``, the prompt prefilled elsewhere: ``k``/``v``
  ([layers, L, kv_heads, head_dim]: the KV of every prompt row), ``logits`` ([V]: next-token logits of the last
  prompt row), ``embeds`` ([L, E]) and ``positions`` ([4, L]: so decode can recompute the rows after a
  preemption), ``delta`` (M-RoPE offset of generated positions) and, when a talker consumes the request,
  ``prompt_states`` ([L, H], complete);
- ``thinker_talker`` (stream): ``ThinkerStates``; the first chunk has ``head`` (``TalkerHead``: ``prompt``
  [L, H], thinker input embeddings with media positions zeroed plus last hidden states; ``bos``/``eos``/``pad``
  [H], thinker embeddings of the voice's text-bos, tts end and tts pad tokens; ``first_token``), every chunk has
  ``states`` ([k, H]: hidden + embedding of each generated token the thinker fed back);
- ``talker_code2wav`` (stream): ``CodecChunk``, codec token ids.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_serve.graphs.messages import Message, StreamChunk, Tensor


# -- calls ---------------------------------------------------------------------------------------------------
class EncoderCall(Message):
    request_id: str


class SamplingSettings(Message):
    temperature: float = Field(ge=0)
    top_p: float = 1.0
    seed: int
    min_new_tokens: int = 0  # the stop tokens cannot end the text before this many tokens


class TalkerPrompt(Message):
    """Thinker token ids the talker's prompt is built from (set when the request asks for speech)."""

    voice_token: int  # the voice's text-bos token
    tts_end_token: int
    tts_pad_token: int


class ThinkerCall(Message):
    request_id: str
    input_ids: list[int]
    max_new_tokens: int = Field(ge=1)
    sampling: SamplingSettings
    stop_token_ids: list[int]
    stop: list[str] = []
    image_grid_thw: list[list[int]] | None = None
    audio_seqlens: list[int] | None = None
    expects_media: bool = False  # media embeddings come on encoder_thinker
    talker: TalkerPrompt | None = None  # a talker consumes this request's states


class TalkerCall(Message):
    request_id: str
    seed: int
    temperature: float = Field(ge=0)  # the request's; a greedy request decodes codes greedily too


class Code2WavCall(Message):
    request_id: str
    voice: str
    seed: int


# -- outputs -------------------------------------------------------------------------------------------------
class TextDelta(Message):
    token_ids: list[int]
    text: str = ""
    finish_reason: Literal["stop", "length"] | None = None


class PrefillDone(Message):
    prompt_tokens: int


class CodecDelta(Message):
    codes: list[int]


class AudioDelta(Message):
    samples: bytes  # float32 little-endian, 24 kHz mono: the ingress encodes them for the client
    num_codes: int  # codec tokens these samples speak


# -- edge payloads -------------------------------------------------------------------------------------------
class MediaInputs(Message):
    input_features: Tensor | None = None  # [n_audio, mel, frames]
    feature_attention_mask: Tensor | None = None  # [n_audio, frames]
    pixel_values: Tensor | None = None  # [patches, patch_dim]
    image_grid_thw: Tensor | None = None  # [n_images, 3]


class RawMedia(Message):
    audio: Tensor | None = None  # [sum of samples] float32, 16 kHz mono, clips concatenated
    audio_lengths: list[int] = []
    images: Tensor | None = None  # [sum of h*w*3] uint8 RGB, images concatenated
    image_sizes: list[list[int]] = []  # [[h, w], ...]


class MediaEmbeddings(Message):
    audio: Tensor | None = None
    image: Tensor | None = None


class PromptHandoff(Message):
    k: Tensor
    v: Tensor
    logits: Tensor
    embeds: Tensor
    positions: Tensor
    delta: int
    prompt_states: Tensor | None = None


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
