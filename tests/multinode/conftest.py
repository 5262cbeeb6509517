"""A real multi-node Ray cluster for the ``multinode`` tests (``scripts/multinode_cluster.py``): a network
namespace, a /dev/shm and a PID namespace per node on one bridge; node death by power-off (one SIGKILL to the
node's PID 1) or by partition (its link cut). Nothing is shared between nodes but the bridge.

They need root (network and mount namespaces) and ``ip``/``unshare``/``nsenter``. Without them the tests skip
with the reason, unless ``OMNI_SERVE_REQUIRE_MULTINODE=1`` (CI sets it), under which a missing requirement fails.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRE_ENV = "OMNI_SERVE_REQUIRE_MULTINODE"
HTTP_PORT = 8000
# Every node's environment: short payload TTLs (leak checks wait for sweeps), one thread per replica.
NODE_ENV = {"OMNI_SERVE_DATA_TTL_S": "20", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _harness():
    spec = importlib.util.spec_from_file_location("multinode_cluster", os.path.join(REPO, "scripts",
                                                                                     "multinode_cluster.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def missing_requirement() -> str | None:
    if os.geteuid() != 0:
        return "multi-node tests need root (network and mount namespaces per node)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"multi-node tests need `{tool}` (iproute2 / util-linux)"
    return None


def require_harness() -> None:
    """Skip (with the reason) where the harness cannot run; fail instead under ``OMNI_SERVE_REQUIRE_MULTINODE=1``."""
    reason = missing_requirement()
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}, and {REQUIRE_ENV}=1 says these tests must run")
        pytest.skip(reason)


class Cluster:
    """The running cluster, seen from the test process (the host's namespaces, on the bridge)."""

    def __init__(self, harness, state):
        self.h, self.state = harness, state
        self.python = sys.executable

    @property
    def head(self):
        return self.state.node("head")

    @property
    def url(self) -> str:
        return f"http://{self.head.ip}:{HTTP_PORT}"

    def ip(self, name: str) -> str:
        return self.state.node(name).ip

    def python_in(self, node: str, code: str, timeout: float = 600) -> str:
        """Run Python ``code`` in ``node``'s namespaces, connected to the cluster; returns its last output line."""
        prelude = (f"import json, ray; ray.init(address='{self.head.ip}:{self.h.RAY_PORT}', namespace='omni_serve', "
                   "logging_level='ERROR', log_to_driver=False)\n")
        out = self.h.run_in(self.state.node(node), [self.python, "-c", prelude + code], capture=True,
                            timeout=timeout, env=NODE_ENV)
        if out.returncode != 0:
            raise RuntimeError(f"python on {node} failed ({out.returncode}):\n{out.stderr[-4000:]}")
        lines = out.stdout.strip().splitlines()
        return lines[-1] if lines else ""

    def deploy(self, family: str, args: dict, name: str, route_prefix: str) -> None:
        """``serve.run`` of a family's app from a driver on the head (the app outlives the driver)."""
        self.h.deploy(self.state, self.python, family, args, name, route_prefix, HTTP_PORT, env=NODE_ENV)

    def directory_keys(self, prefix: str = "") -> list[str]:
        code = ("from omni_serve.transport.directory import directory\n"
                "import asyncio\n"
                f"print(json.dumps(asyncio.run(directory().call('keys', {prefix!r}))))")
        return json.loads(self.python_in("head", code, timeout=120))

    def shm_files(self, node: str) -> list[str]:
        """Index files and stream markers under the node's shared-memory tree (its own /dev/shm)."""
        out = self.h.run_in(self.state.node(node), ["find", "/dev/shm", "-path", "*/keys/*", "-type", "f"],
                            capture=True, timeout=60)
        return out.stdout.split()

    def shm_leftovers(self, nodes: list[str]) -> dict[str, list[str]]:
        """``shm_files`` of each of ``nodes`` that holds any (printed: what a failed wait saw last)."""
        left = {n: files for n in nodes if (files := self.shm_files(n))}
        if left:
            print(f"left in /dev/shm: {left}", flush=True)
        return left

    def power_off(self, name: str) -> None:
        self.h.power_off(self.state, name)

    def partition(self, name: str, heal: bool = False) -> None:
        self.h.partition(self.state, name, heal=heal)

    def join(self, name: str, resources: dict[str, float]) -> None:
        self.h.add_node(self.state, name, self.python, resources, env=NODE_ENV)

    def alive_nodes(self) -> int:
        return self.h.live_nodes(self.head, self.python)


@pytest.fixture(scope="module")
def http(cluster):
    """An HTTP client of the module's ``cluster`` fixture (its graph, at the head's IP)."""
    import httpx

    with httpx.Client(base_url=cluster.url, timeout=300) as client:
        yield client


def start_cluster(resources: list[dict[str, float]]) -> Cluster:
    """A head and ``len(resources) - 1`` workers, node i with custom resources ``resources[i]``."""
    require_harness()
    harness = _harness()
    harness.down()  # whatever a crashed run left
    try:
        state = harness.up(len(resources) - 1, sys.executable, resources, env=NODE_ENV)
    except BaseException:
        harness.down()
        raise
    return Cluster(harness, state)


def stop_cluster(cluster: Cluster) -> None:
    cluster.h.down()


def wait_until(predicate, timeout_s: float, period_s: float = 0.5, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(period_s)
    raise AssertionError(f"{what} did not hold within {timeout_s:.0f} s (last: {last!r})")


