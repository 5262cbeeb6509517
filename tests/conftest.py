"""Shared fixtures: one tiny checkpoint per family and session (made once, reused across runs)."""

from __future__ import annotations

import fcntl
import os
from collections import defaultdict

import pytest

from tests.postgres import postgres  # noqa: F401 - the session's PostgreSQL server (a fixture), one per session

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Unread data-plane payloads (late chunks of cancelled requests) are swept after this in every process the tests
# start (Ray's workers inherit it): the leak and fault tests wait for those sweeps, and the serving default (120 s)
# would make each wait two minutes. A consumer here reads its payload within seconds, even under the load tests.
os.environ.setdefault("OMNI_SERVE_DATA_TTL_S", "45")


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


_MODULE_SECONDS: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    _MODULE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration  # setup, call and teardown alike


def pytest_terminal_summary(terminalreporter):
    """Wall time per test module (set-up and teardown included, which is where shared clusters and servers go):
    where a run's time is, to keep the suite under CI's hour."""
    if not _MODULE_SECONDS:
        return
    terminalreporter.section("slowest 25 modules")
    for path, seconds in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")
    terminalreporter.write_line(f"{sum(_MODULE_SECONDS.values()):8.1f}s  in all")


# Where the Makefile points the tests (other families: OMNI_SERVE_TEST_<FAMILY>_CHECKPOINT, or checkpoints/).
CHECKPOINT_ENV = {"qwen2_5_omni": "OMNI_SERVE_TEST_CHECKPOINT", "qwen_image": "OMNI_SERVE_TEST_IMAGE_CHECKPOINT"}
# The file a family's checkpoint writer writes last (a directory without it is incomplete).
LAST_WRITTEN = {"qwen2_5_omni": "spk_dict.pt"}


def tiny_checkpoint(family: str) -> str:
    """The tiny checkpoint of a registered family (or of a model whose writer is in ``UNSERVED_WRITERS``), at its
    environment variable's path or checkpoints/<family>-tiny, written by its checkpoint writer if it is missing."""
    from omni_serve.checkpoints import UNSERVED_WRITERS
    from omni_serve.graph.registry import families, import_path

    env = CHECKPOINT_ENV.get(family, f"OMNI_SERVE_TEST_{family.upper()}_CHECKPOINT")
    path = os.environ.get(env, os.path.join(REPO, "checkpoints", f"{family}-tiny"))
    last = os.path.join(path, LAST_WRITTEN.get(family, "omni_serve_checkpoint.json"))
    if os.path.exists(last):
        return path
    # Several test processes may need the same checkpoint at once (pytest-xdist, two sessions): one writes it, the
    # others wait for it on the lock.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(os.path.abspath(path).rstrip("/") + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(last):
            writer = UNSERVED_WRITERS.get(family) or families()[family].checkpoint_writer
            import_path(writer)(path, "tiny")
    return path


@pytest.fixture(scope="session")
def omni_tiny_dir() -> str:
    """Path of the tiny Qwen2.5-Omni checkpoint (``make checkpoint`` writes it; made here if missing)."""
    return tiny_checkpoint("qwen2_5_omni")


@pytest.fixture(scope="session")
def qwen_image_tiny_dir() -> str:
    """Path of the tiny Qwen-Image checkpoint (``make checkpoint`` writes it; made here if missing)."""
    return tiny_checkpoint("qwen_image")


@pytest.fixture(scope="session")
def qwen3_omni_tiny_dir() -> str:
    """Path of the tiny Qwen3-Omni checkpoint (made here if missing)."""
    return tiny_checkpoint("qwen3_omni")


@pytest.fixture(scope="session")
def wan_tiny_dir() -> str:
    return tiny_checkpoint("wan")


@pytest.fixture(scope="session")
def wan_i2v_tiny_dir() -> str:
    return tiny_checkpoint("wan_i2v")


@pytest.fixture(scope="session")
def glm_image_tiny_dir() -> str:
    """Path of the tiny GLM-Image checkpoint (made here if missing)."""
    return tiny_checkpoint("glm_image")


@pytest.fixture(scope="session")
def qwen3_asr_tiny_dir() -> str:
    """Path of the tiny Qwen3-ASR checkpoint (made here if missing)."""
    return tiny_checkpoint("qwen3_asr")


@pytest.fixture(scope="session")
def vibevoice_tiny_dir() -> str:
    """Path of the tiny VibeVoice checkpoint (made here if missing)."""
    return tiny_checkpoint("vibevoice")
