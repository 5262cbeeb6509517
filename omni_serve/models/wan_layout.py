"""What a Wan checkpoint directory (diffusers layout, text- or image-to-video) says without loading any weights.

Contract: ``size_rules(dir) -> (multiple, temporal)``, torch-free, for the ingress's request checks: video sides
must be multiples of ``multiple`` (the VAE's spatial compression times the transformer's patch: 16), frame counts
``temporal * k + 1`` (the VAE's temporal compression: 4).
"""

from __future__ import annotations

import json
import os


def _config(checkpoint_dir: str, part: str) -> dict:
    with open(os.path.join(checkpoint_dir, part, "config.json")) as f:
        return json.load(f)


def size_rules(checkpoint_dir: str) -> tuple[int, int]:
    vae, transformer = _config(checkpoint_dir, "vae"), _config(checkpoint_dir, "transformer")
    multiple = vae.get("scale_factor_spatial", 8) * transformer.get("patch_size", [1, 2, 2])[1]
    return multiple, vae.get("scale_factor_temporal", 4)
