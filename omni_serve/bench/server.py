"""The local server a benchmark measured, stopped before its baseline runs (a quiet machine for the baseline).

Contract: ``stop_server(pid, timeout_s)`` sends SIGTERM to the ``omni-serve serve`` process ``pid`` (it shuts Serve
and Ray down) and returns once it has exited, or warns after ``timeout_s`` and returns anyway.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def stop_server(pid: int, timeout_s: float = 120.0) -> None:
    """SIGTERM the local server and wait until it has exited (it shuts Ray down first)."""
    import os
    import signal
    import time

    log.info("stopping the server (pid %d) before the baseline ...", pid)
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    log.warning("server pid %d still running after %.0f s; the baseline runs anyway", pid, timeout_s)
