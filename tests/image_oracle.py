"""The Qwen-Image families' oracle comparison, shared by their unit and integration tests and by
benchmarks/*/*_oracle_margins.py (which measure the numbers below).

A served image equals diffusers' pipeline (same checkpoint and seed) when its final latents (the packed latents
before the VAE decode, what the pipeline returns with ``output_type="latent"``) are within ``LATENT_ATOL`` and
its uint8 pixels within a level or so. Pixels alone cannot tell requests apart on the tiny checkpoints: with
random weights a swapped prompt moves the image by 1-6 levels, often 1-2. The latents can. Measured on the tiny
checkpoints (CPU; benchmarks/qwen_image/generation_oracle_margins.py and benchmarks/qwen_image_edit/edit_oracle_margins.py print them):

    served vs diffusers (float rounding: thread counts and batch partners change the order of sums)  <= 1.7e-6
    a swapped prompt: generations 3.0e-2 .. 1.4e-1; edits 1.3e-4 .. 4e-4 (the image dominates an edit)
    a swapped input image (edits) ~4e-3 .. 7e-3; a swapped seed ~5

So the tolerance sits between rounding and a swap, ``SWAP_MARGIN`` times below the smallest swap, and the
negative controls (``assert_swaps_fail``) run the very same comparison on the reference of a swapped prompt and
a swapped seed (and, for edits, image or mask) and check that it fails by that margin.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from PIL import Image

LATENT_ATOL = 1e-5  # max |served - diffusers| of the final latents (float32)
SWAP_MARGIN = 10  # a swapped prompt or seed must move the latents by more than SWAP_MARGIN * LATENT_ATOL


@dataclass
class Result:
    """What the oracle compares of one request: its images' final latents [n, S, C] and uint8 pixels
    [n, H, W, 3]."""

    latents: torch.Tensor
    pixels: np.ndarray | None  # None: not computed (a negative control's reference, where the latents decide)


def pipeline_result(pipe, seed: int, pixels: bool = True, **kwargs) -> Result:
    """diffusers' pipeline on ``seed``: its final latents (what ``output_type="latent"`` returns) and, unless
    ``pixels`` is False, its uint8 images, from one run: the final latents are the last the pipelines (Qwen-Image,
    -Edit, -Edit-Inpaint, GLM-Image) hand ``callback_on_step_end`` (after each denoising step) before decoding them.
    A run per output type computed the same latents twice, bit for bit: seconds per edit reference on CPU."""
    if not pixels:
        return Result(pipe(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="latent").images,
                      None)
    final = {}

    def keep(pipeline, step, timestep, tensors):  # the latents after each step: the last call's are the final ones
        final["latents"] = tensors["latents"].clone()
        return {}

    images = pipe(**kwargs, generator=torch.Generator().manual_seed(seed), output_type="np",
                  callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"]).images
    return Result(final["latents"], (images * 255).round().astype(np.uint8))


def decode_pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def decode_latents(latents) -> torch.Tensor:
    """One data item's ``latents`` (``return_latents``: base64 little-endian float32 and a shape)."""
    latents = latents if isinstance(latents, dict) else latents.model_dump()
    assert latents["dtype"] == "float32", latents["dtype"]
    flat = np.frombuffer(base64.b64decode(latents["data"]), dtype="<f4")
    return torch.from_numpy(flat.reshape(latents["shape"]).copy())


def response_result(data: list) -> Result:
    """The ``Result`` of an image response's ``data`` (JSON dicts or ``ImageData``), asked with ``return_latents``."""
    items = [d if isinstance(d, dict) else d.model_dump() for d in data]
    assert all(d.get("latents") for d in items), "the response carries no latents (return_latents)"
    return Result(torch.stack([decode_latents(d["latents"]) for d in items]),
                  np.stack([decode_pixels(d["b64_json"]) for d in items]))


def latent_distance(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.detach().float().cpu() - ref.detach().float().cpu()).abs().max())


def assert_matches(got: Result, ref: Result, what: str = "", pixel_levels: int = 1,
                   atol: float = LATENT_ATOL) -> float:
    """The oracle: ``got`` equals the reference ``ref`` (latents within ``atol``, pixels within ``pixel_levels``);
    returns the latents' max |diff|."""
    assert got.latents.shape == ref.latents.shape, (what, got.latents.shape, ref.latents.shape)
    distance = latent_distance(got.latents, ref.latents)
    assert distance <= atol, f"{what}: the latents differ by up to {distance:.2e} > {atol:.0e}"
    assert got.pixels.shape == ref.pixels.shape, (what, got.pixels.shape, ref.pixels.shape)
    levels = int(np.abs(got.pixels.astype(int) - ref.pixels).max())
    assert levels <= pixel_levels, f"{what}: the pixels differ by up to {levels} levels > {pixel_levels}"
    return distance


def assert_swaps_fail(got: Result, swapped: dict[str, Result], positive: float, what: str = "",
                      pixel_levels: int = 1, atol: float = LATENT_ATOL) -> None:
    """Negative controls: ``got`` (which passed ``assert_matches`` at latent distance ``positive``) must fail the
    same comparison against the reference of each swapped request (name -> its ``Result``), by more than
    ``SWAP_MARGIN`` times the tolerance. Prints the margins."""
    print(f"\n{what}: latents max |diff| vs diffusers {positive:.1e} (tolerance {atol:.0e})")
    for name, other in swapped.items():
        with pytest.raises(AssertionError, match="the latents differ"):
            assert_matches(got, other, f"{what}, {name} swapped", pixel_levels, atol)
        distance = latent_distance(got.latents, other.latents)
        levels = "" if other.pixels is None else \
            f", pixels {int(np.abs(got.pixels.astype(int) - other.pixels).max())} levels"
        print(f"  vs the reference with {name} swapped: latents {distance:.1e} ({distance / atol:.0f}x the "
              f"tolerance){levels}")
        assert distance > SWAP_MARGIN * atol, (
            f"{what}: swapping the {name} moves the latents by only {distance:.1e}, not clearly beyond the "
            f"tolerance {atol:.0e}")
