"""What crosses a Qwen-Omni graph's boundaries on the encoder and thinker side (see ``omni_serve.graph.messages``):
the messages every Omni family shares. A family adds its talker-side messages (the thinker -> talker stream, the
talker's call and codec payloads) in its own ``messages`` module.

Calls (ingress -> stage): ``EncoderCall``, ``ThinkerCall`` (every thinker stage of the layout gets the same one;
``talker`` is the ``TalkerPrompt`` when a talker consumes the request), ``Code2WavCall``.
Outputs (stage -> ingress): ``TextDelta`` (the text stage: ``thinker`` or ``thinker_decode``), ``PrefillDone``
(``thinker_prefill``), ``AudioDelta`` (code2wav: float32 samples).
Edge payloads (one per request):
- ``ingress_encoder``: ``MediaInputs``, the processor's audio features, image patches and video patches;
- ``encoder_thinker``: ``MediaEmbeddings``, ``audio`` [n_a, H], ``image`` [n_i, H] and ``video`` [n_v, H]
  (present per media; a family's encoder may widen the rows, see its messages);
- ``ingress_thinker`` (thinker on vLLM): ``RawMedia``, the decoded clips (``audio`` [sum of samples] float32 at
  16 kHz, ``audio_lengths``) and images (``images`` [sum of h*w*3] uint8 RGB, ``image_sizes`` [[h, w], ...]), in
  prompt order;
- ``thinker_prefill_thinker_decode``: ``PromptHandoff``, the prompt prefilled elsewhere: ``k``/``v``
  ([layers, L, kv_heads, head_dim]: the KV of every prompt row), ``logits`` ([V]: next-token logits of the last
  prompt row), ``embeds`` ([L, E]) and ``positions`` ([4, L]: so decode can recompute the rows after a
  preemption), ``delta`` (M-RoPE offset of generated positions) and, when a talker consumes the request,
  ``prompt_states`` ([L, H], complete).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_serve.graph.messages import Message, Tensor


# -- calls ---------------------------------------------------------------------------------------------------
class EncoderCall(Message):
    request_id: str


class SamplingSettings(Message):
    temperature: float = Field(ge=0)
    top_p: float = 1.0
    seed: int
    min_new_tokens: int = 0  # the stop tokens cannot end the text before this many tokens
    presence_penalty: float = 0.0  # OpenAI's, over the tokens generated so far
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # each text token's log-probability with this many top alternatives; None: none
    json_schema: str | None = None  # the reply is constrained to JSON this schema (JSON text) accepts; None: free
    grammar: str | None = None  # or to this Lark grammar (llguidance's dialect: a forced tool call); None: free
    logit_bias: list[tuple[int, float]] = []  # (token id, added to its logit): OpenAI's logit_bias, by token id


class MediaLayout(Message):
    """Where a prompt's media sit, as the M-RoPE index (transformers' ``get_rope_index``) needs it: the thinker's
    and the talker's prompt positions. Small metadata, no tensors."""

    image_grid_thw: list[list[int]] | None = None
    video_grid_thw: list[list[int]] | None = None
    video_second_per_grid: list[float] | None = None  # seconds per temporal patch of each video
    audio_seqlens: list[int] | None = None  # feature frames per audio clip (a video's track included)
    use_audio_in_video: bool = False  # each video's audio tokens are interleaved with its video tokens

    @classmethod
    def of(cls, inputs) -> "MediaLayout | None":
        """From a processor's inputs (``OmniInputs``); None for a prompt without media."""
        def rows(x):
            return None if x is None else x.tolist()
        layout = cls(image_grid_thw=rows(inputs.image_grid_thw), video_grid_thw=rows(inputs.video_grid_thw),
                     video_second_per_grid=rows(inputs.video_second_per_grid),
                     audio_seqlens=rows(inputs.audio_seqlens), use_audio_in_video=inputs.use_audio_in_video)
        return None if layout == cls() else layout

    def rope_kwargs(self) -> dict:
        """The keyword arguments of the models' ``prompt_positions`` (tensors, as ``get_rope_index`` takes them)."""
        import torch

        def tensor(x, dtype=torch.long):
            return None if x is None else torch.tensor(x, dtype=dtype)
        return {"image_grid_thw": tensor(self.image_grid_thw), "video_grid_thw": tensor(self.video_grid_thw),
                "second_per_grids": tensor(self.video_second_per_grid, torch.float32),
                "audio_seqlens": tensor(self.audio_seqlens), "use_audio_in_video": self.use_audio_in_video}


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
    media_layout: MediaLayout | None = None  # the prompt's media (M-RoPE); None: a text prompt
    expects_media: bool = False  # media embeddings come on encoder_thinker
    talker: TalkerPrompt | None = None  # a talker consumes this request's states
    # Text to speak (``/v1/audio/speech``): the reply's token ids, its end token last, forced instead of sampled.
    # The thinker computes the prompt and every forced token it would have fed back in one prefill, then ends.
    forced_reply: list[int] | None = Field(default=None, min_length=2)


class Code2WavCall(Message):
    request_id: str
    voice: str
    seed: int


# -- outputs -------------------------------------------------------------------------------------------------
class TokenLogprob(Message):
    """A generated token's log-probability under the model's raw distribution (log-softmax of its logits, before
    any sampling processor), with the most likely tokens at its position."""

    logprob: float
    top: list[tuple[int, float]] = []  # (token id, log-probability), most likely first


class TextDelta(Message):
    token_ids: list[int]
    text: str = ""
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the call's sampling asked for them


class PrefillDone(Message):
    prompt_tokens: int


class AudioDelta(Message):
    samples: bytes  # float32 little-endian, 24 kHz mono: the ingress encodes them for the client
    num_codes: int  # codec tokens these samples speak


# -- edge payloads -------------------------------------------------------------------------------------------
class MediaInputs(Message):
    input_features: Tensor | None = None  # [n_audio, mel, frames]
    feature_attention_mask: Tensor | None = None  # [n_audio, frames]
    pixel_values: Tensor | None = None  # [patches, patch_dim]
    image_grid_thw: Tensor | None = None  # [n_images, 3]
    pixel_values_videos: Tensor | None = None  # [patches, patch_dim]
    video_grid_thw: Tensor | None = None  # [n_videos, 3]

    @classmethod
    def of(cls, inputs) -> "MediaInputs | None":
        """The encoder's share of a processor's inputs (``OmniInputs``); None for a prompt without media."""
        if not inputs.has_media:
            return None
        return cls(input_features=inputs.input_features, feature_attention_mask=inputs.feature_attention_mask,
                   pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                   pixel_values_videos=inputs.pixel_values_videos, video_grid_thw=inputs.video_grid_thw)


class RawMedia(Message):
    audio: Tensor | None = None  # [sum of samples] float32, 16 kHz mono, clips concatenated
    audio_lengths: list[int] = []
    images: Tensor | None = None  # [sum of h*w*3] uint8 RGB, images concatenated
    image_sizes: list[list[int]] = []  # [[h, w], ...]


class MediaEmbeddings(Message):
    audio: Tensor | None = None
    image: Tensor | None = None
    video: Tensor | None = None


class PromptHandoff(Message):
    k: Tensor
    v: Tensor
    logits: Tensor
    embeds: Tensor
    positions: Tensor
    delta: int
    prompt_states: Tensor | None = None
