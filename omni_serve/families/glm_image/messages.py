"""What crosses the GLM-Image graph's boundaries (see ``omni_serve.graph.messages``).

Calls (ingress -> stage): ``PriorCall`` (ar), ``GlmDenoiseCall`` (dit), and the diffusion kit's ``TextEncodeCall``
(text_encoder: the glyph encoder; the negative prompt is ``""`` under CFG) and ``DecodeCall`` (vae).
Outputs (stage -> ingress): ``PriorDone`` (prompt and generated token counts), and the diffusion kit's ``PromptEncoded``,
``DenoiseDone`` and ``ImagesEncoded``.
Edge payloads: ``PriorTokens`` (ar -> dit: the DiT's prior token ids, one per DiT image token), the diffusion kit's
``PromptEmbeds`` (text_encoder -> dit: the prompt's glyph embeddings and, under CFG, those of ``""``) and
``FinalLatents`` (dit -> vae: latents ``[n, C, h, w]``).
"""

from __future__ import annotations

from pydantic import Field

from omni_serve.graph.messages import Message, Tensor
from omni_serve.kits.diffusion.messages import (  # noqa: F401 - this graph's messages, importable from here
    BaseDenoiseCall, DecodeCall, DenoiseDone, FinalLatents, ImagesEncoded, PromptEmbeds, PromptEncoded, TextEncodeCall,
)


# -- calls ---------------------------------------------------------------------------------------------------
class PriorCall(Message):
    request_id: str
    prompt: str
    height: int = Field(ge=1)
    width: int = Field(ge=1)
    seed: int  # the AR samples with it (the pipeline seeds torch with it before generate)


class GlmDenoiseCall(BaseDenoiseCall):
    guidance_scale: float = 1.0  # CFG runs when > 1


# -- outputs -------------------------------------------------------------------------------------------------
class PriorDone(Message):
    prompt_tokens: int
    generated_tokens: int



# -- edge payloads -------------------------------------------------------------------------------------------
class PriorTokens(Message):
    tokens: Tensor  # [4 * rows * cols] int64: the target grid's visual tokens, upsampled 2x
