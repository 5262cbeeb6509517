"""What crosses a text encoder -> DiT -> VAE graph's boundaries (see ``omni_serve.graph.messages``); the
diffusion families declare these in their graphs and add their own.

Calls (ingress -> stage): ``TextEncodeCall`` (text_encoder), ``DenoiseCall`` or ``VideoDenoiseCall`` (dit),
``DecodeCall`` or ``VideoDecodeCall`` (vae). Outputs (stage -> ingress): ``PromptEncoded``, ``DenoiseProgress`` (a
video's steps as they go), ``DenoiseDone`` (step counts for the response's metrics), ``ImagesEncoded`` or
``VideosEncoded`` (the encoded images or videos, and with ``return_latents`` the latents they were decoded from).
Edge payloads: ``PromptEmbeds`` (text_encoder -> dit: prompt and negative-prompt embeddings, [L, D] each),
``FinalLatents`` (dit -> vae: packed image latents [n, S, 4C], or video latents [n, C, F', H', W']).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from omni_serve.graph.messages import Message, Tensor


class CacheSettings(Message):
    """cache-dit settings of one request (the stage's defaults with the request's overrides)."""

    mode: Literal["off", "dbcache", "taylorseer"] = "off"
    fn_compute_blocks: int = 1
    bn_compute_blocks: int = 0
    residual_diff_threshold: float = 0.08
    max_warmup_steps: int = 2
    max_cached_steps: int = -1
    max_continuous_cached_steps: int = -1
    taylorseer_order: int = 1


# -- calls ---------------------------------------------------------------------------------------------------
class TextEncodeCall(Message):
    request_id: str
    prompt: str
    negative_prompt: str | None = None  # encoded only when true CFG runs


class BaseDenoiseCall(Message):
    """What every DiT stage's call carries: the request, its image count and size, steps and seed. A family
    whose guidance differs subclasses this rather than ``DenoiseCall``."""

    request_id: str
    n: int = Field(ge=1)
    height: int = Field(ge=1)
    width: int = Field(ge=1)
    num_steps: int = Field(ge=1)
    seed: int


class DenoiseCall(BaseDenoiseCall):
    true_cfg_scale: float = 1.0  # CFG runs when > 1 and negative embeddings arrive
    guidance_scale: float | None = None  # guidance-distilled transformers only
    cache: CacheSettings | None = None  # None: no cache acceleration


class VideoDenoiseCall(DenoiseCall):
    """A video's denoising: ``num_frames`` frames (the latents' frame count follows the VAE's temporal compression).
    Guidance is ``true_cfg_scale`` with the negative prompt's embeddings (an empty prompt's when none was given).
    With ``report_progress`` the stage sends a ``DenoiseProgress`` after every step (a job's ``progress``)."""

    num_frames: int = Field(ge=1)
    report_progress: bool = True


class VideoDecodeCall(Message):
    request_id: str
    fps: int = Field(ge=1)
    # mp4: H.264; npz: the exact uint8 frames and the final latents, a NumPy archive (checking against a reference)
    output_format: Literal["mp4", "npz"] = "mp4"
    return_latents: bool = False  # also send back the final latents the videos were decoded from


class DecodeCall(Message):
    request_id: str
    height: int = Field(ge=1)
    width: int = Field(ge=1)
    output_format: Literal["png", "jpeg", "webp"] = "png"
    return_latents: bool = False  # also send back the final latents the images were decoded from


# -- outputs -------------------------------------------------------------------------------------------------
class PromptEncoded(Message):
    prompt_tokens: int


class DenoiseDone(Message):
    num_steps: int
    true_cfg: bool
    cached_steps: int
    computed_steps: int


class DenoiseProgress(Message):
    """Steps done of a request's denoising (``VideoDenoiseCall.report_progress``)."""

    step: int
    num_steps: int


class VideosEncoded(Message):
    """Each video as a file's bytes (``VideoDecodeCall.output_format``: an MP4, or a NumPy archive of its ``frames``
    and ``latents``) and its first frame as a PNG; with ``return_latents`` the final latents as ``ImagesEncoded``
    carries them."""

    videos: list[bytes]
    thumbnails: list[bytes]
    num_frames: int
    latents: list[bytes] = []
    latent_shape: list[int] = []


class ImagesEncoded(Message):
    images: list[bytes]
    # return_latents: each image's final packed latents [S, 4C] (the DiT -> VAE payload, before the decode) as
    # little-endian float32 bytes, all of shape ``latent_shape``
    latents: list[bytes] = []
    latent_shape: list[int] = []


# -- edge payloads -------------------------------------------------------------------------------------------
class PromptEmbeds(Message):
    prompt_embeds: Tensor
    negative_embeds: Tensor | None = None


class FinalLatents(Message):
    latents: Tensor
