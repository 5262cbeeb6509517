"""The GLM-Image bench's baseline: diffusers' ``GlmImagePipeline`` in this process (``benchmarks.diffusers_image``),
the CFG scale as ``guidance_scale``.

Contract: ``load_pipeline(checkpoint, torch_dtype)``; ``from_config(ImageBenchConfig)`` is the baseline
``run_image_bench`` runs (``DiffusersImageBaseline``).
"""

from __future__ import annotations

from benchmarks.diffusers_image import from_loader


def load_pipeline(checkpoint: str, dtype):
    from diffusers import GlmImagePipeline

    return GlmImagePipeline.from_pretrained(checkpoint, local_files_only=True, dtype=dtype)


from_config = from_loader(load_pipeline, glm=True)
