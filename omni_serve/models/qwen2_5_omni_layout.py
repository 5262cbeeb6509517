"""What a Qwen2.5-Omni checkpoint directory (Hugging Face layout) says without loading any model weights.

Contract: readers for the ingress (request checks) and the adapters: ``load_config(dir)`` (the
``Qwen2_5OmniConfig``), ``load_speakers(dir)`` (``spk_dict.pt``: per voice its ``bos_token``, ``cond`` and
``ref_mel``), ``SAMPLE_RATE`` of the generated speech. No model code is imported here.
"""

from __future__ import annotations

import os

SAMPLE_RATE = 24000


def load_config(checkpoint_dir: str):
    from transformers import Qwen2_5OmniConfig

    return Qwen2_5OmniConfig.from_pretrained(checkpoint_dir)


def load_speakers(checkpoint_dir: str) -> dict:
    import torch

    path = os.path.join(checkpoint_dir, "spk_dict.pt")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: a Qwen2.5-Omni checkpoint ships its voices there")
    return torch.load(path, map_location="cpu", weights_only=True)
