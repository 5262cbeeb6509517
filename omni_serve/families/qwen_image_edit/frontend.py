"""Ingress side of the Qwen-Image-Edit graph: ``POST /v1/images/edits`` (OpenAI's ``images.edit``, multipart) ->
stage calls -> OpenAI image response.

Contract: ``QwenImageEditFrontend(spec, stages)`` serves ``images_edits(body, ctx)``. It validates the request
(the diffusion kit's limits on size, count, steps, prompt length and cache; one input image, its file size and pixel
count checked before it is decoded; 400s are raised before any stage is called), resizes the input image to its
conditioning size as diffusers' ``QwenImageEditPipeline`` does (the input's aspect ratio at ~1 MP, multiples of
32, its ``VaeImageProcessor.resize``; aspect ratios beyond 200:1, which its prompt encoder cannot take, are a 400),
puts it on both ingress edges, opens the four stage calls at once and returns an ``ImageGenerationResponse``. The output size is the request's ``size``, else the spec's
``default_size``, which by default ('auto') is the conditioning size, as in the pipeline.

With a ``mask`` (OpenAI's: a PNG of the image's size whose fully transparent pixels mark what to edit) the edit
is inpainting, as diffusers' ``QwenImageEditInpaintPipeline``: the mask is binarized at the conditioning size
(its ``mask_processor``) and sent to the DiT, which repaints only the masked area, ``strength`` (default 1: the
masked area entirely) of the way; the output keeps the conditioning size.

``ImageEditRequest`` is the form: the files ``image`` (or ``image[]``, as the official client sends a list) and
``mask``, OpenAI's fields, and the generation extensions (seed, steps, CFG, negative prompt; cache settings as
``cache[mode]``, ``cache[residual_diff_threshold]``, ``cache[max_warmup_steps]`` form fields).
"""

from __future__ import annotations

import asyncio
import math
import os

import numpy as np
import torch
from fastapi import UploadFile
from PIL import Image
from pydantic import Field, ValidationError

from omni_serve.api.errors import bad_request
from omni_serve.api.images import CacheOptions, ImageGenerationRequest, ImageGenerationResponse
from omni_serve.api.media import decode_image_bytes, read_upload
from omni_serve.graph.calls import StageCalls
from omni_serve.graph.frontend import Frontend, RequestContext, Route
from omni_serve.kits.diffusion.frontend import ImageRequestChecks, collect_images, image_response
from omni_serve.families.qwen_image_edit.messages import (
    DecodeCall, EditDenoiseCall, EncodeImageCall, InpaintMask, InputImage, TextEncodeCall,
)
from omni_serve.families.qwen_image_edit.spec import QwenImageEditGraphSpec
from omni_serve.models.qwen_image_layout import pixel_multiple
from omni_serve.request_ids import new_request_id

CONDITION_PIXELS = 1024 * 1024  # the pipeline resizes the input image to this area (QwenImageEditPipeline.__call__)
MAX_ASPECT_RATIO = 200  # the most the prompt encoder's image processor takes (transformers' smart_resize)


def condition_size(width: int, height: int) -> tuple[int, int]:
    """The pipeline's conditioning size of an input image: its aspect ratio at ``CONDITION_PIXELS``, each side
    rounded to a multiple of 32 (diffusers' ``calculate_dimensions``, which lives in the pipeline module: importing
    it would load diffusers' model code into the ingress)."""
    ratio = width / height
    w = math.sqrt(CONDITION_PIXELS * ratio)
    return round(w / 32) * 32, round(w / ratio / 32) * 32


class ImageEditRequest(ImageGenerationRequest):
    """OpenAI's image edit request (multipart/form-data) plus the generation extensions."""

    image: list[UploadFile] = Field(default_factory=list, description="The image to edit (PNG, JPEG or WebP).")
    image_list: list[UploadFile] = Field(default_factory=list, alias="image[]", description=(
        "The image to edit, as the official client sends a list (this model edits one image)."))
    mask: UploadFile | None = Field(default=None, description=(
        "A PNG of the image's size whose fully transparent pixels mark the area to edit (inpainting)."))
    strength: float | None = Field(default=None, gt=0, le=1, description=(
        "Inpainting (with a mask): how far the masked area is repainted, 1 (the default) entirely; lower keeps more "
        "of the input there. omni_serve extension."))
    background: str | None = Field(default=None, description="Accepted and ignored.")
    input_fidelity: str | None = Field(default=None, description="Accepted and ignored.")
    # The generations API's ``cache`` object, as the form fields the official client flattens it into; checked by
    # ``with_cache_options`` (so a bad value is a 400 naming ``cache.<field>``, as for generations).
    cache_mode: str | None = Field(default=None, alias="cache[mode]", description="cache.mode, as a form field.")
    cache_threshold: str | None = Field(default=None, alias="cache[residual_diff_threshold]",
                                        description="cache.residual_diff_threshold, as a form field.")
    cache_warmup: str | None = Field(default=None, alias="cache[max_warmup_steps]",
                                     description="cache.max_warmup_steps, as a form field.")

    def with_cache_options(self) -> "ImageEditRequest":
        """The request with ``cache`` set from the form fields (a 400 for a bad one)."""
        fields = {"mode": self.cache_mode, "residual_diff_threshold": self.cache_threshold,
                  "max_warmup_steps": self.cache_warmup}
        fields = {k: v for k, v in fields.items() if v is not None}
        if not fields:
            return self
        try:
            return self.model_copy(update={"cache": CacheOptions.model_validate(fields)})
        except ValidationError as exc:
            err = exc.errors()[0]
            raise bad_request(f"cache.{err['loc'][0]}: {err['msg']}", param=f"cache.{err['loc'][0]}") from None

    def images(self) -> list[UploadFile]:
        return [*self.image, *self.image_list]


class QwenImageEditFrontend(Frontend):
    routes = (Route("/v1/images/edits", "images_edits", "images_edits", ImageEditRequest, form=True,
                    summary="Edit an image following a prompt (OpenAI images.edit)."),)

    def __init__(self, spec: QwenImageEditGraphSpec, stages: StageCalls):
        from diffusers.image_processor import VaeImageProcessor

        super().__init__(spec, stages)
        self.checks = ImageRequestChecks(spec, os.path.join(spec.checkpoint, "processor"))
        if spec.default_dimensions() is not None:
            self.checks.check_size(*spec.default_dimensions(), param="default_size")
        # the pipelines' own resize of the input image (PIL, lanczos) and binarization of the mask
        self.resizer = VaeImageProcessor(vae_scale_factor=pixel_multiple(spec.checkpoint))
        self.mask_processor = VaeImageProcessor(vae_scale_factor=pixel_multiple(spec.checkpoint), do_normalize=False,
                                                do_binarize=True, do_convert_grayscale=True)

    async def _decoded(self, upload: UploadFile, param: str, mode: str = "RGB"):
        raw = await read_upload(upload, self.spec.max_input_bytes, param)
        return await asyncio.to_thread(decode_image_bytes, raw, max_pixels=self.spec.max_input_pixels, param=param,
                                       mode=mode, formats=self.spec.limits.image_formats)

    async def _inputs(self, req: ImageEditRequest):
        """(the input image, the inpainting mask as an L image, 255 = repaint, or None)."""
        files = req.images()
        if not files:
            raise bad_request("image is required: the image to edit, as a file.", param="image")
        if len(files) > 1:
            raise bad_request(f"this model edits one image at a time ({len(files)} were sent).", param="image")
        if req.strength is not None and req.mask is None:
            raise bad_request("strength applies to edits with a mask.", param="strength")
        image = await self._decoded(files[0], "image")
        cond = condition_size(*image.size)
        if min(cond) < 32 or max(cond) > MAX_ASPECT_RATIO * min(cond):
            raise bad_request(f"image is {image.size[0]}x{image.size[1]}: its aspect ratio must be at most "
                              f"{MAX_ASPECT_RATIO}:1 (at the ~1 MP conditioning size, {cond[0]}x{cond[1]}).",
                              param="image")
        if req.mask is None:
            return image, None
        mask = await self._decoded(req.mask, "mask", mode="RGBA")
        if mask.size != image.size:
            raise bad_request(f"mask size {mask.size[0]}x{mask.size[1]} does not match the image's "
                              f"{image.size[0]}x{image.size[1]}.", param="mask")
        alpha = np.asarray(mask)[..., 3]
        if not (alpha == 0).any():
            raise bad_request("mask has no fully transparent pixel: its transparent area marks what to edit.",
                              param="mask")
        return image, Image.fromarray(np.where(alpha == 0, 255, 0).astype(np.uint8), mode="L")

    def _conditioning(self, image, width: int, height: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.resizer.resize(image, height, width)).copy())

    def _mask(self, mask, width: int, height: int) -> torch.Tensor:
        binary = self.mask_processor.preprocess(mask, height=height, width=width)  # [1, 1, H, W] of 0/1
        return binary[0, 0].to(torch.uint8)

    def _output_size(self, req: ImageEditRequest, condition: tuple[int, int], masked: bool) -> tuple[int, int]:
        """(width, height): the request's size, else the spec's default, else (and always with a mask, as the
        inpainting pipeline) the conditioning size."""
        if masked:
            size = req.dimensions(condition)
            if size != condition:
                raise bad_request(f"an edit with a mask keeps the input image's size scaled to ~1 MP, "
                                  f"{condition[0]}x{condition[1]}: leave size out (or 'auto').", param="size")
        else:
            size = req.dimensions(self.spec.default_dimensions() or condition)
        self.checks.check_size(*size)
        return size

    async def images_edits(self, req: ImageEditRequest, ctx: RequestContext) -> ImageGenerationResponse:
        c = self.checks
        req = req.with_cache_options()
        c.check_model(req.model)
        c.check_count(req.n)
        steps = c.steps(req.num_inference_steps)
        tokens = await c.prompt_tokens(req)
        cache = c.cache(req)
        image, mask = await self._inputs(req)
        cond_w, cond_h = condition_size(*image.size)
        width, height = self._output_size(req, (cond_w, cond_h), masked=mask is not None)
        strength = None if mask is None else (1.0 if req.strength is None else req.strength)
        cfg_scale, guidance = c.guidance(req)
        pixels = await asyncio.to_thread(self._conditioning, image, cond_w, cond_h)
        inputs = {"ingress_text_encoder": InputImage(pixels=pixels), "ingress_vae_encoder": InputImage(pixels=pixels)}
        if mask is not None:
            inputs["ingress_dit"] = InpaintMask(mask=await asyncio.to_thread(self._mask, mask, cond_w, cond_h))
        rid = new_request_id("imgedit")
        negative = req.negative_prompt if cfg_scale > 1 else None
        seed = c.seed(req.seed)
        calls = {
            "text_encoder": TextEncodeCall(request_id=rid, prompt=req.prompt, negative_prompt=negative),
            # inpainting samples the image's latents with the request's generator (as the pipeline)
            "vae_encoder": EncodeImageCall(request_id=rid, sample_seed=seed if mask is not None else None),
            "dit": EditDenoiseCall(request_id=rid, n=req.n, height=height, width=width, num_steps=steps,
                                   seed=seed, true_cfg_scale=cfg_scale, guidance_scale=guidance,
                                   cache=cache, condition_height=cond_h, condition_width=cond_w, strength=strength),
            "vae": DecodeCall(request_id=rid, height=height, width=width, output_format=req.output_format or "png",
                              return_latents=req.return_latents),
        }
        images, done = await collect_images(self.stages, rid, calls, ctx.timeout_s, inputs=inputs)
        return image_response(images, done, cache, req.n, tokens)
