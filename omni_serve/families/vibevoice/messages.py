"""What crosses the VibeVoice graph's boundaries (see ``omni_serve.graph.messages``).

Call (ingress -> lm): ``SpeakCall``: the prompt's token ids (the script's template, each speaker's voice placeholder
expanded to its clip's frames), the speakers in placeholder order, the seed and the request's overrides.
Edge payload (ingress -> lm, ``ingress_lm``): ``VoiceClips``: each speaker's reference clip (24 kHz mono float32), in
the speakers' order.
Outputs (lm -> ingress): ``SpeechAudio`` (one speech token's audio: 3200 float32 samples at 24 kHz, in order),
``SpeechFinished`` (counts and why it stopped).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_serve.graph.messages import Message, Tensor


class SpeakCall(Message):
    request_id: str
    input_ids: list[int] = Field(min_length=1)
    speakers: list[str] = Field(min_length=1)
    seed: int
    max_new_tokens: int = Field(ge=1)
    guidance_scale: float | None = None  # None: the checkpoint's generation config
    num_diffusion_steps: int | None = Field(default=None, ge=1, le=1000)


class VoiceClips(Message):
    clips: list[Tensor]  # [samples] float32 at 24 kHz, one per speaker


class SpeechAudio(Message):
    index: int  # the speech token's rank
    samples: bytes  # float32 little-endian, 24 kHz mono


class SpeechFinished(Message):
    prompt_tokens: int
    generated_tokens: int
    speech_tokens: int
    finish_reason: Literal["stop", "length"]
