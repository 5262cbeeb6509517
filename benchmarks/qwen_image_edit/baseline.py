"""The Qwen-Image-Edit bench's baseline: diffusers' ``QwenImageEditPipeline`` in this process, with the served graph's
prompt processor as the oracle tests use it (``benchmarks.diffusers_image``).

Contract: ``load_pipeline(checkpoint, torch_dtype)``; ``from_config(ImageBenchConfig)`` is the baseline
``run_image_bench`` runs (``DiffusersImageBaseline``).
"""

from __future__ import annotations

from benchmarks.diffusers_image import from_loader


def load_pipeline(checkpoint: str, dtype):
    from diffusers import QwenImageEditPipeline

    from omni_serve.models.qwen_image_edit import EditPromptProcessor

    # Qwen2VLProcessor needs torchvision (no CPU build here): the served graph's processor, as the oracle
    pipe = QwenImageEditPipeline.from_pretrained(checkpoint, processor=None, local_files_only=True, dtype=dtype)
    pipe.register_modules(processor=EditPromptProcessor.from_pretrained(checkpoint))
    return pipe


from_config = from_loader(load_pipeline)
