"""What a Qwen3-Omni checkpoint directory (Hugging Face layout) says without loading any model weights.

Contract: readers for the ingress (request checks) and the adapters: ``load_config(dir)`` (the
``Qwen3OmniMoeConfig``), ``voices(config)`` (voice name -> codec speaker id, from ``talker_config.speaker_id``),
``SAMPLE_RATE`` of the generated speech. No model code is imported here.
"""

from __future__ import annotations

SAMPLE_RATE = 24000


def load_config(checkpoint_dir: str):
    from transformers import Qwen3OmniMoeConfig

    return Qwen3OmniMoeConfig.from_pretrained(checkpoint_dir)


def voices(config) -> dict[str, int]:
    """Voice name (as the checkpoint spells it) -> the talker's speaker codec id."""
    return dict(config.talker_config.speaker_id or {})
