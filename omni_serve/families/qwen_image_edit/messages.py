"""What crosses the Qwen-Image-Edit graph's boundaries (see ``omni_serve.graph.messages``); the diffusion kit's messages
(``omni_serve.kits.diffusion.messages``) where the stages are the same.

Calls (ingress -> stage): ``TextEncodeCall`` (text_encoder), ``EncodeImageCall`` (vae_encoder),
``EditDenoiseCall`` (dit: the diffusion kit's ``DenoiseCall`` plus the conditioning size), ``DecodeCall`` (vae).
Outputs (stage -> ingress): ``PromptEncoded``, ``DenoiseDone``, ``ImagesEncoded``.
Edge payloads: ``InputImage`` (ingress -> text_encoder and ingress -> vae_encoder: the input image, already
resized to the conditioning size, uint8 [H, W, 3]), ``InpaintMask`` (ingress -> dit, inpainting only: the
binarized mask at the conditioning size), ``PromptEmbeds`` (text_encoder -> dit), ``ConditionLatents``
(vae_encoder -> dit: the image's packed latents [S_c, C]), ``FinalLatents`` (dit -> vae).
"""

from __future__ import annotations

from pydantic import Field

from omni_serve.graph.messages import Message, Tensor
from omni_serve.kits.diffusion.messages import (  # noqa: F401 - this graph's messages, importable from here
    CacheSettings, DecodeCall, DenoiseCall, DenoiseDone, FinalLatents, ImagesEncoded, PromptEmbeds, PromptEncoded,
    TextEncodeCall,
)


class EncodeImageCall(Message):
    request_id: str
    sample_seed: int | None = None  # inpainting: sample the latent distribution with this seed's generator


class EditDenoiseCall(DenoiseCall):
    condition_height: int = Field(ge=1)  # the input image's conditioning size (pixels)
    condition_width: int = Field(ge=1)
    strength: float | None = Field(default=None, gt=0, le=1)  # inpainting (a mask comes on ingress_dit) when set


class InputImage(Message):
    pixels: Tensor  # uint8 [H, W, 3]


class InpaintMask(Message):
    mask: Tensor  # uint8 [H, W] at the conditioning size: 1 where the image is repainted, 0 where it is kept


class ConditionLatents(Message):
    latents: Tensor  # [S_c, C], packed like the DiT's latents
