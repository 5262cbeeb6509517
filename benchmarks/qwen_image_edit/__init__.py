"""The qwen_image_edit bench plug-in (Qwen-Image-Edit: image edits, ``--endpoint edits``, vs diffusers'
QwenImageEditPipeline): the shared image mode (``benchmarks.image_mode``) with this family's baseline
(``baseline.py``). Run recipe: ``run.sh`` with ``small.yaml``; the other scripts time an edit's stages and measure
the oracle margins."""

from __future__ import annotations

from benchmarks.image_mode import MODES, image_mode
from omni_serve.bench.plugins import BenchPlugin


def _from_config(cfg):
    from benchmarks.qwen_image_edit.baseline import from_config

    return from_config(cfg)


_add_arguments, _run = image_mode(_from_config)
BENCH = BenchPlugin(family="qwen_image_edit", modes=MODES, add_arguments=_add_arguments, run=_run)
