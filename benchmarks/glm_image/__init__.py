"""The glm_image bench plug-in (GLM-Image: image generation vs diffusers' GlmImagePipeline, the CFG scale as
guidance_scale): the shared image mode (``benchmarks.image_mode``) with this family's baseline (``baseline.py``).
Run recipe: ``run.sh`` with ``small.yaml``; compute ceiling: ``ceiling.py``."""

from __future__ import annotations

from benchmarks.image_mode import MODES, image_mode
from omni_serve.bench.plugins import BenchPlugin


def _from_config(cfg):
    from benchmarks.glm_image.baseline import from_config

    return from_config(cfg)


_add_arguments, _run = image_mode(_from_config)
BENCH = BenchPlugin(family="glm_image", modes=MODES, add_arguments=_add_arguments, run=_run)
