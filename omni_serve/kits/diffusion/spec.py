"""The request limits and defaults of an image graph (``ImageGraphSpec``), shared by the diffusion families.

A family's spec subclasses ``ImageGraphSpec``, redeclaring ``checkpoint`` and ``model_name`` with its own
description and default (a redeclared field keeps its place in the generated reference) and adding its
``stages``/``edges`` sections derived from its graph declaration.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from omni_serve.graph.spec import GraphSpecBase


class ImageGraphSpec(GraphSpecBase):
    checkpoint: str = Field(..., description="Local checkpoint directory (diffusers layout).")
    model_name: str = Field(..., description="Model id served at /v1/models and accepted in requests.")
    default_size: str = Field("256x256", description="Image size when a request gives none ('WIDTHxHEIGHT').")
    max_side: int = Field(2048, ge=16, description="Largest width or height accepted (pixels).")
    max_pixels: int = Field(2048 * 2048, ge=256, description="Largest width x height accepted.")
    max_images: int = Field(4, ge=1, le=16, description="Most images per request (n).")
    default_steps: int = Field(20, ge=1, description="Denoising steps when a request gives none.")
    max_steps: int = Field(100, ge=1, description="Most denoising steps a request may ask for.")
    default_true_cfg_scale: float = Field(4.0, ge=0, description=(
        "CFG scale when a request gives a negative_prompt but no scale (as diffusers' default)."))
    default_guidance_scale: float = Field(1.0, ge=0, description="Distilled guidance (guidance-distilled models only).")

    # default_size words besides WIDTHxHEIGHT that the family accepts ('auto' for edits)
    size_words: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _check(self) -> "ImageGraphSpec":
        if self.default_steps > self.max_steps:
            raise ValueError("default_steps must be <= max_steps")
        if self.default_size not in self.size_words and self.default_dimensions() is None:
            raise ValueError(f"default_size must be {' or '.join([*map(repr, self.size_words), repr('WIDTHxHEIGHT')])}")
        return self

    def default_dimensions(self) -> tuple[int, int] | None:
        """(width, height) of ``default_size``; None when it is one of ``size_words``."""
        return size_dimensions(self.default_size)


def size_dimensions(size: str) -> tuple[int, int] | None:
    """(width, height) of a 'WIDTHxHEIGHT' size, None if it is not one."""
    parts = size.split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])
