"""What a GLM-Image checkpoint directory (diffusers layout) says without loading any weights.

Contract: torch-free, for the ingress (request limits), the adapters and the checkpoint writer: ``GRID_FACTOR``
(pixels per AR visual token: image sides must be multiples of it; ``GlmImageProcessor`` hard-codes it),
``AR_SUBFOLDER`` (the AR model's folder) and ``vae_scale_factor(dir)`` (pixels per latent cell, from the VAE config,
as the pipeline computes it).
"""

from __future__ import annotations

import json
import os

GRID_FACTOR = 32
AR_SUBFOLDER = "vision_language_encoder"


def vae_scale_factor(checkpoint_dir: str) -> int:
    """The pipeline's ``2 ** (len(vae.config.block_out_channels) - 1)``."""
    with open(os.path.join(checkpoint_dir, "vae", "config.json")) as f:
        return 2 ** (len(json.load(f)["block_out_channels"]) - 1)
