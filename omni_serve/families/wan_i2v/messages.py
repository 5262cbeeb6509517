"""What crosses the Wan image-to-video graph's boundaries (see ``omni_serve.graph.messages``); the diffusion kit's
messages (``omni_serve.kits.diffusion.messages``) where the stages are the same.

Calls (ingress -> stage): ``TextEncodeCall`` (text_encoder), ``EncodeImageCall`` (image_encoder),
``EncodeFirstFrameCall`` (vae_encoder: the video's frame count), ``VideoDenoiseCall`` (dit), ``VideoDecodeCall``
(vae). Outputs (stage -> ingress): ``PromptEncoded``, ``DenoiseProgress``, ``DenoiseDone``, ``VideosEncoded``.
Edge payloads: ``InputImage`` (ingress -> image_encoder and ingress -> vae_encoder: the first frame, uint8
[H, W, 3] at the video's size), ``PromptEmbeds`` (text_encoder -> dit), ``ImageEmbeds`` (image_encoder -> dit: CLIP
tokens [L, D]), ``FirstFrameLatents`` (vae_encoder -> dit: mask and first-frame latents [4 + C, F', H', W']),
``FinalLatents`` (dit -> vae).
"""

from __future__ import annotations

from pydantic import Field

from omni_serve.graph.messages import Message, Tensor
from omni_serve.kits.diffusion.messages import (  # noqa: F401 - this graph's messages, importable from here
    DenoiseDone, DenoiseProgress, FinalLatents, PromptEmbeds, PromptEncoded, TextEncodeCall, VideoDecodeCall,
    VideoDenoiseCall, VideosEncoded,
)


class EncodeImageCall(Message):
    request_id: str


class EncodeFirstFrameCall(Message):
    request_id: str
    num_frames: int = Field(ge=1)  # the video's: the first frame is encoded followed by num_frames - 1 black ones


class InputImage(Message):
    pixels: Tensor  # uint8 [H, W, 3], the video's size


class ImageEmbeds(Message):
    embeds: Tensor  # [L, D]: the image encoder's tokens


class FirstFrameLatents(Message):
    latents: Tensor  # [4 + C, F', H', W']: the first-frame mask, then the normalised latents
