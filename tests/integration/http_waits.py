"""Waiting on an HTTP endpoint in integration tests (a server starting, a graph recovering)."""

from __future__ import annotations

import time
from typing import Callable

import httpx


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
