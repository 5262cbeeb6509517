"""What a Qwen-Image checkpoint directory (diffusers layout) says without loading any weights.

Contract: torch-free readers of the component configs, for the ingress (request limits) and the adapters:
``vae_scale_factor(dir)`` (pixels per latent cell), ``pixel_multiple(dir)`` (image sides must be multiples of it:
VAE downsampling x the transformer's 2x2 patches), ``guidance_embeds(dir)`` (a guidance-distilled transformer).
"""

from __future__ import annotations

import json
import os

VAE_SUBFOLDER, TRANSFORMER_SUBFOLDER, TOKENIZER_SUBFOLDER = "vae", "transformer", "tokenizer"


def _config(checkpoint_dir: str, subfolder: str) -> dict:
    with open(os.path.join(checkpoint_dir, subfolder, "config.json")) as f:
        return json.load(f)


def vae_scale_factor(checkpoint_dir: str) -> int:
    """Pixels per latent cell, read from the VAE config."""
    return 2 ** len(_config(checkpoint_dir, VAE_SUBFOLDER)["temperal_downsample"])


def pixel_multiple(checkpoint_dir: str) -> int:
    """Image sides must be multiples of this (VAE downsampling x the transformer's 2x2 patches)."""
    return vae_scale_factor(checkpoint_dir) * 2


def guidance_embeds(checkpoint_dir: str) -> bool:
    """Whether the transformer is guidance-distilled (takes guidance_scale as an input)."""
    return bool(_config(checkpoint_dir, TRANSFORMER_SUBFOLDER).get("guidance_embeds", False))
