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


def _tiny_checkpoint(family: str, env: str, marker: str) -> str:
    """The tiny checkpoint of ``family`` at ``$env`` or checkpoints/<family>-tiny, written if ``marker`` is missing."""
    import importlib

    path = os.environ.get(env, os.path.join(REPO, "checkpoints", f"{family}-tiny"))
    if not os.path.exists(os.path.join(path, marker)):
        importlib.import_module(f"omni_serve.checkpoints.{family}").make_checkpoint(path, "tiny")
    return path


@pytest.fixture(scope="session")
def omni_tiny_dir() -> str:
    """Path of the tiny Qwen2.5-Omni checkpoint (``make checkpoint`` writes it; made here if missing)."""
    return _tiny_checkpoint("qwen2_5_omni", "OMNI_SERVE_TEST_CHECKPOINT", "spk_dict.pt")


@pytest.fixture(scope="session")
def qwen_image_tiny_dir() -> str:
    """Path of the tiny Qwen-Image checkpoint (``make checkpoint`` writes it; made here if missing)."""
    return _tiny_checkpoint("qwen_image", "OMNI_SERVE_TEST_IMAGE_CHECKPOINT", "omni_serve_checkpoint.json")
