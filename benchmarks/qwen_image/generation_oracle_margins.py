"""The margins behind the Qwen-Image generation oracle's tolerance (tests/image_oracle.py, LATENT_ATOL): how far
the served latents are from diffusers' (float rounding), and how far a swapped prompt or seed moves diffusers'
own latents and pixels, on the tiny checkpoint.

    PYTHONPATH=. .venv/bin/python benchmarks/qwen_image/generation_oracle_margins.py   (it reuses the HTTP test's cases)

Runs the served graph's cases (tests/integration/test_qwen_image_graph.py) all in flight through the family's
in-process graph (``LocalGraph``: its frontend, runners and engines, with ``return_latents``) and
``QwenImagePipeline`` one by one, then each case with the next case's prompt, and its seed.
"""

from __future__ import annotations

import asyncio

import numpy as np
from diffusers import QwenImagePipeline

from omni_serve.api.images import ImageGenerationRequest
from omni_serve.graph.frontend import RequestContext
from omni_serve.graph.local import LocalGraph
from omni_serve.families.qwen_image import FAMILY
from tests.conftest import tiny_checkpoint
from tests.image_oracle import latent_distance, response_result
from tests.integration.test_qwen_image_graph import CASES, case_reference, swapped_references


async def serve(checkpoint: str, cases: list[dict]) -> list:
    # the HTTP test's app settings (tests/integration/conftest.py, image_app)
    async with LocalGraph(FAMILY, {"checkpoint": checkpoint, "default_size": "64x64", "default_steps": 4}) as graph:
        requests = [ImageGenerationRequest(**c, return_latents=True) for c in cases]
        responses = await asyncio.gather(*(graph.frontend.images_generations(r, RequestContext(timeout_s=600))
                                           for r in requests))
    return [response_result(r.data) for r in responses]


def main() -> None:
    checkpoint = tiny_checkpoint("qwen_image")
    pipe = QwenImagePipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    served = asyncio.run(serve(checkpoint, CASES))
    for i, (case, got) in enumerate(zip(CASES, served)):
        ref = case_reference(pipe, case)
        print(f"{case['prompt']!r}: served vs diffusers: latents max |diff| "
              f"{latent_distance(got.latents, ref.latents):.2e}, "
              f"pixels {int(np.abs(got.pixels.astype(int) - ref.pixels).max())}")
        for name, other in swapped_references(pipe, CASES, i).items():
            print(f"    {name} swapped: latents move {latent_distance(ref.latents, other.latents):.2e}, "
                  f"pixels {int(np.abs(ref.pixels.astype(int) - other.pixels).max())}")


if __name__ == "__main__":
    main()
