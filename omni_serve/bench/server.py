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


def baseline_phase(cfg, requests, baseline, chosen: str | None, calibration: dict[str, float],
                   notes: list[str]) -> list:
    """What a bench does once its engine runs ended: stop the server (``cfg.stop_server_pid``: the baseline gets a
    quiet machine), then, when a baseline is ``chosen`` (its name, e.g. "diffusers"), time the CPU calibration again
    if the engine runs had one (a drift beyond ``calibration.DRIFT_WARN`` becomes a note) and run ``baseline(cfg)``
    on ``requests``. Returns the baseline's runs (none or one); ``ValueError`` when one is chosen but the family's
    bench gave none."""
    if cfg.stop_server_pid is not None:
        stop_server(cfg.stop_server_pid)
        notes.append("the server was stopped before the baseline ran")
    if chosen is None:
        return []
    if baseline is None:
        raise ValueError(f"the {chosen} baseline needs the served family's bench (--graph)")
    if calibration:
        from omni_serve.bench.calibration import calibrate, drift_note

        calibration["baseline"] = round(calibrate(), 5)
        drift = drift_note(calibration["engine"], calibration["baseline"])
        if drift:
            log.warning(drift)
            notes.append(drift)
    log.info("loading the %s baseline from %s ...", chosen, cfg.checkpoint)
    return [baseline(cfg).run(requests, warmup=cfg.warmup, progress_every=cfg.progress_every)]
