"""The row a diffusion transformer's batched forward takes, shared by the model adapters whose DiT runs the diffusion
kit's programs (Qwen-Image and its edit pipelines, Wan): one latent at one timestep with its text, whatever the
latent's shape (packed image tokens [S, C], a video's [C, F', H', W'])."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DenoiseRow:
    """One transformer input row: a latent at one timestep, conditioned on text [L, D] and, for image-conditioned
    pipelines, on image latents (appended to the sequence in Qwen-Image-Edit, stacked on the channels in Wan's
    image-to-video) and on image tokens (Wan's image-to-video: CLIP's, attended beside the text)."""

    latents: torch.Tensor
    timestep: torch.Tensor  # scalar, the scheduler's t (0..1000)
    text: torch.Tensor
    guidance: float | None = None  # only for guidance-distilled transformers
    condition: torch.Tensor | None = None  # conditioning image latents (on ``predict``'s condition_grid)
    image: torch.Tensor | None = None  # image tokens [L_i, D_i] (Wan image-to-video)
