"""What crosses the Qwen3-Omni graph's boundaries (see ``omni_serve.graph.messages``).

The calls, the thinker's outputs and the media/hand-off payloads are the Omni kit's (same meaning, re-exported
here); what differs is the talker side:
- ``ThinkerCall.talker`` (``TalkerPrompt``): ``voice_token`` is the tts bos token, ``tts_end_token`` /
  ``tts_pad_token`` the tts eos / pad tokens (thinker ids whose embeddings the talker's prompt uses);
- ``encoder_thinker``: ``MediaEmbeddings.image`` / ``video`` are ``[n, (1 + D) * H]``, each image (video) token's
  embedding followed by its D deepstack features (``omni_serve.models.qwen3_omni``);
- ``thinker_talker`` (stream): ``ThinkerStates``; the first chunk has ``head`` (``TalkerHead``: ``user`` [U, H],
  per row of the prompt's user turns the thinker's accept-layer hidden state (media rows, ``user_is_media``) or
  its input embedding; ``user_ids``, those rows' token ids (the talker's M-RoPE); ``assistant`` [A, H], the
  embeddings of the prompt rows from the assistant turn's ``<|im_start|>`` on; ``tts`` [3, H], the embeddings
  of the tts bos/eos/pad tokens); every chunk has ``states`` ([k, H]: the embedding of each generated token the
  thinker fed back, in order);
- ``talker_code2wav`` (stream): ``CodecChunk``, codec frames (``G`` codes each, first codebook first);
- ``CodecDelta`` (talker output): the frames drawn, sent only when the call asks (``return_token_ids``).
"""

from __future__ import annotations

from pydantic import Field

from omni_serve.graph.messages import Message, StreamChunk, Tensor
from omni_serve.kits.omni.messages import (  # noqa: F401 - the shared messages, importable from here
    AudioDelta, Code2WavCall, EncoderCall, MediaEmbeddings, MediaInputs, MediaLayout, PrefillDone, PromptHandoff,
    SamplingSettings, TalkerPrompt, TextDelta, ThinkerCall,
)


class TalkerCall(Message):
    request_id: str
    voice: str  # a key of the checkpoint's talker_config.speaker_id
    seed: int
    temperature: float = Field(ge=0)  # the request's; a greedy request decodes codes greedily too
    paced: bool = False  # its client plays the audio as it comes: the talker keeps playback.talker_lead_s ahead
    media_layout: MediaLayout | None = None  # the prompt's media, for the talker's M-RoPE
    return_frames: bool = False  # send the frames to the ingress too (CodecDelta: return_token_ids)


class CodecDelta(Message):
    frames: list[list[int]]


class TalkerHead(Message):
    user: Tensor
    user_is_media: Tensor
    user_ids: list[int]
    assistant: Tensor
    tts: Tensor


class ThinkerStates(StreamChunk):
    states: Tensor | None = None
    head: TalkerHead | None = None  # first chunk only


class CodecChunk(StreamChunk):
    frames: list[list[int]]
