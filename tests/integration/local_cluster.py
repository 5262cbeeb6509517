"""A local Ray cluster of its own (``ray start --head`` with its dashboard, not the test session's), for tests that
take the operator's path: ``serve deploy`` and ``serve status`` through the dashboard's REST API.

Contract: ``with local_cluster(num_cpus) as dashboard:`` starts it (its GCS, dashboard and HTTP ports are the
module constants) and yields the dashboard's URL; on exit Serve is shut down and every process of the cluster
stopped. ``cli(*args)`` runs a command with Ray's token authentication off, as the cluster runs;
``wait_running(app)`` waits for an application to be RUNNING and returns its details.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import httpx

from tests.integration.http_waits import wait_for_200

BIN = os.path.dirname(sys.executable)
GCS_PORT, DASHBOARD_PORT, HTTP_PORT = 6391, 8266, 8012
DASHBOARD = f"http://127.0.0.1:{DASHBOARD_PORT}"
URL = f"http://127.0.0.1:{HTTP_PORT}"
TEMP_DIR = "/tmp/omni_serve_cluster"  # short: Ray's socket paths have a length limit


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


@contextlib.contextmanager
def local_cluster(num_cpus: int) -> Iterator[str]:
    proc = subprocess.Popen(
        [f"{BIN}/ray", "start", "--head", "--block", f"--port={GCS_PORT}", f"--num-cpus={num_cpus}",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={DASHBOARD_PORT}",
         "--dashboard-agent-listen-port=52366", f"--temp-dir={TEMP_DIR}", "--disable-usage-stats"],
        env={**os.environ, "RAY_AUTH_MODE": "disabled"}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for_200(f"{DASHBOARD}/api/serve/applications/", 180, "the dashboard did not come up",
                     alive=lambda: proc.poll() is None)
        yield DASHBOARD
    finally:
        cli(f"{BIN}/serve", "shutdown", "-y", "-a", DASHBOARD, timeout=120)
        if proc.poll() is None:
            # Serve has stopped every replica: what is left is Ray's own daemons. ``ray start --block`` stops them on
            # SIGTERM in ~2 s when nothing else is left, but waits ~30 s for stragglers after a graph with several
            # applications; so it gets a few seconds, then the whole group is killed
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
        subprocess.run(["pkill", "-9", "-f", TEMP_DIR], check=False)  # anything the cluster left behind


def applications() -> dict:
    return httpx.get(f"{DASHBOARD}/api/serve/applications/", timeout=10).json()["applications"]


def wait_running(app: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            apps = applications()
        except httpx.HTTPError as exc:
            # the dashboard answers slowly while two cores start a graph's replicas (a 10 s read timeout was
            # seen in CI): ask again until the deadline instead of failing the wait on one slow answer
            assert time.monotonic() < deadline, f"the dashboard did not answer: {exc!r}"
            time.sleep(2)
            continue
        status = apps.get(app, {}).get("status")
        if status == "RUNNING":
            return apps[app]
        assert status != "DEPLOY_FAILED", apps[app].get("message")
        assert time.monotonic() < deadline, f"{app} is {status}"
        time.sleep(2)
