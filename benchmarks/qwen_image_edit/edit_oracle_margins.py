"""The margins behind the Qwen-Image-Edit oracle's tolerance (tests/image_oracle.py, LATENT_ATOL):
how far the served latents are from diffusers' (float rounding), and how far a swapped prompt, input image or seed
moves diffusers' own latents and pixels, on the tiny checkpoint.

    PYTHONPATH=. .venv/bin/python benchmarks/qwen_image_edit/edit_oracle_margins.py   (it reuses the unit test's cases)

Runs the unit test's six edit cases in flight through the family's in-process graph (``LocalGraph``) and
``QwenImageEditPipeline`` one by one, then the first case with one thing swapped.
"""

from __future__ import annotations

import asyncio

import numpy as np

from tests.conftest import tiny_checkpoint
from tests.image_oracle import latent_distance
from tests.unit.test_qwen_image_edit import CASES, reference, reference_pipeline, serve


def main() -> None:
    checkpoint = tiny_checkpoint("qwen_image_edit")
    pipe = reference_pipeline(checkpoint)
    refs = [reference(pipe, c) for c in CASES]
    served = asyncio.run(serve(checkpoint, CASES))
    for case, ref, (got, _, _) in zip(CASES, refs, served):
        print(f"served vs diffusers, {case['prompt']!r}: "
              f"latents max |diff| {latent_distance(got.latents, ref.latents):.2e}, "
              f"pixels max |diff| {int(np.abs(got.pixels.astype(int) - ref.pixels).max())}")
    for swap in ({"prompt": "add a cat"}, {"prompt": "make the sky blue"}, {"image": CASES[5]["image"]}, {"seed": 99}):
        other = reference(pipe, {**CASES[0], **swap})
        print(f"diffusers, first case with {sorted(swap)} swapped: "
              f"latents move {latent_distance(refs[0].latents, other.latents):.2e}, "
              f"pixels {int(np.abs(refs[0].pixels.astype(int) - other.pixels).max())}")


if __name__ == "__main__":
    main()
