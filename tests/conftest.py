"""Shared fixtures: one tiny Qwen2.5-Omni checkpoint per session (made once, reused across runs)."""

from __future__ import annotations

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def omni_tiny_dir() -> str:
    """Path of the tiny Qwen2.5-Omni checkpoint (``make checkpoints`` writes it; made here if missing)."""
    from omni_serve.checkpoints.qwen2_5_omni import make_checkpoint

    path = os.environ.get("OMNI_SERVE_TEST_CHECKPOINT", os.path.join(REPO, "checkpoints", "qwen2_5_omni-tiny"))
    if not os.path.exists(os.path.join(path, "spk_dict.pt")):
        make_checkpoint(path, "tiny")
    return path
