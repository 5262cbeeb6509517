"""Waiting in integration tests: on a condition, or on an HTTP endpoint (a server starting, a graph recovering)."""

from __future__ import annotations

import time
from typing import Callable

import httpx


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``condition()`` until it is true; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} (waited {timeout} s)"
        time.sleep(interval)


def wait_for_200(url: str, timeout: float, what: str, alive: Callable[[], bool] = lambda: True) -> None:
    """Poll ``url`` until it answers 200; fail with ``what`` after ``timeout`` s or once ``alive()`` is False."""
    deadline = time.monotonic() + timeout
    while True:
        assert alive(), f"{what}: the process serving it exited"
        try:
            if httpx.get(url, timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, what
        time.sleep(1)


def busy_stages(base_url: str, timeout: float = 60) -> dict:
    """Stages of the graph at ``base_url`` (its ``/health``) that still hold a request or KV blocks, or do not
    answer, after waiting up to ``timeout`` s for cancelled work to drain; ``{}`` once every stage is idle."""
    deadline = time.monotonic() + timeout
    while True:
        stages = httpx.get(f"{base_url}/health?fresh=1", timeout=30).json()["stages"]
        busy = {s: info for s, info in stages.items()
                if "error" in info or info.get("active") or info.get("kv_blocks_used")}
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.5)


def ray_directory_size() -> int:
    """Payloads the ``ray`` connector's directory still holds (every graph of the session shares it)."""
    import ray

    from omni_serve import settings
    from omni_serve.transport.directory import DIRECTORY_NAME

    return ray.get(ray.get_actor(DIRECTORY_NAME, namespace=settings.RAY_NAMESPACE).size.remote())


def shm_leftovers() -> tuple[list[str], list[str]]:
    """(segments holding a payload, unread index files) in this node's shared-memory area (the ``shm`` connector,
    and ``auto`` on one node)."""
    from omni_serve.transport.shm import tree_path

    root = tree_path()
    busy = []
    for seg in root.glob("pools/*/seg.*"):
        with open(seg, "rb") as f:
            if f.read(1) != b"\x00":
                busy.append(str(seg))
    unread = [str(p) for p in root.glob("keys/**/*") if p.is_file() and p.name.isdigit()]
    return busy, unread


def held_payloads() -> int:
    """Payloads the session's graphs hold on the node's connectors (ray directory, shared memory)."""
    busy, unread = shm_leftovers()
    return ray_directory_size() + len(busy) + len(unread)
