"""The qwen_image bench plug-in (Qwen-Image: image generation vs diffusers' QwenImagePipeline): the shared image mode
(``benchmarks.image_mode``) with this family's baseline (``baseline.py``); the image mode's default family. Run
recipe: ``run.sh`` with ``small.yaml``; compute ceiling: ``ceiling.py``; the other scripts time the DiT's batching
and an image wave, and measure the oracle margins."""

from __future__ import annotations

from benchmarks.image_mode import MODES, image_mode
from omni_serve.bench.plugins import BenchPlugin


def _from_config(cfg):
    from benchmarks.qwen_image.baseline import from_config

    return from_config(cfg)


_add_arguments, _run = image_mode(_from_config)
BENCH = BenchPlugin(family="qwen_image", modes=MODES, add_arguments=_add_arguments, run=_run, default_for=("image",))
