#!/usr/bin/env python3
"""A real multi-node Ray cluster on one machine: one network namespace, one /dev/shm and one PID namespace per node.

Usage (root, or CAP_NET_ADMIN + CAP_SYS_ADMIN):
    python scripts/multinode_cluster.py up [--workers 2] [--python .venv/bin/python]
    python scripts/multinode_cluster.py status
    python scripts/multinode_cluster.py exec head -- python -c "import ray; ray.init('auto'); print(ray.nodes())"
    python scripts/multinode_cluster.py power-off worker1      # SIGKILL to the node's PID 1: the machine is gone
    python scripts/multinode_cluster.py partition worker1      # cut its link; heal puts it back
    python scripts/multinode_cluster.py join worker3 --resources '{"omni_speech": 10}'   # a replacement machine
    python scripts/multinode_cluster.py deploy qwen_image '{"checkpoint": "/abs/ckpt"}'  # serve.run from the head
    python scripts/multinode_cluster.py down                   # tears everything down, whatever state it is in

Each node is a network namespace (``omni-<node>``) on a bridge (``omni-br0``, 10.77.0.0/24, veth MTU 65000: Mooncake
TCP crawls at 1500), with its own tmpfs on ``/dev/shm`` (a private mount namespace) and its own Ray temp dir. Every
node runs in a PID namespace whose PID 1 is ``ray start --block``: one SIGKILL to it ends every process of that
"machine" at once, as a power-off does. The head also gets Ray's health-check settings that bound node-death
detection to a few seconds. Nothing is shared between nodes but the bridge: not ``/dev/shm``, not loopback
(``ray.cluster_utils.Cluster`` shares both, so it cannot test per-node shared memory or cross-node addresses).

``exec NODE -- CMD`` runs a command inside the node's network, mount and PID namespaces (its IP, its ``/dev/shm``):
drivers, ``serve run`` and clients run there. The state (node PIDs, namespaces) is kept in
``/tmp/omni-multinode/state.json``; ``down`` removes by PID and by name, so a crashed run leaves nothing behind
(the nodes' logs stay in ``/tmp/omni-multinode/`` until the next ``up``).

Checked on this project's 2-core machines: three nodes up in ~10 s; each node sees its own IP and only its own
``/dev/shm``; with the head's health-check settings Ray counts a powered-off node dead after ~3 s and a partitioned
one after ~6 s.

Why not containers: the machine has no container runtime, and these are the kernel features a container runtime
would use; ``ip``, ``unshare`` and ``nsenter`` are all it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

STATE_DIR = "/tmp/omni-multinode"
STATE = os.path.join(STATE_DIR, "state.json")
BRIDGE = "omni-br0"
SUBNET = "10.77.0"
GATEWAY = f"{SUBNET}.1"
PREFIX = "omni-"
RAY_PORT = 6379
# Fixed agent ports (each node has its own network namespace, so they never clash): Ray otherwise picks random
# ones and a node that restarts may announce ports the others cannot reach in time.
NODE_PORTS = ("--node-manager-port=6380 --object-manager-port=6381 --dashboard-agent-grpc-port=6382 "
              "--dashboard-agent-listen-port=6383 --metrics-export-port=6384 --runtime-env-agent-port=6385")
# Node-death detection in ~2-6 s instead of ~13 s (power-off) to ~60 s (partition): set on the head.
# Ray's token authentication off: the nodes talk over a private bridge, and drivers entering a node's namespaces
# would otherwise need the head's token.
NODE_ENV = {"RAY_AUTH_MODE": "disabled"}
HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                "RAY_health_check_failure_threshold": "3"}


@dataclass
class Node:
    name: str  # "head", "worker1", ...
    ip: str
    resources: dict[str, float]
    pid: int | None = None  # host PID of the node's PID 1 (its ``ray start --block``)
    partitioned: bool = False

    @property
    def netns(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def veth(self) -> str:
        return f"{PREFIX}v-{self.name}"[:15]  # interface names are at most 15 characters

    @property
    def temp_dir(self) -> str:
        return os.path.join(STATE_DIR, self.name)


@dataclass
class ClusterState:
    nodes: list[Node] = field(default_factory=list)

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise SystemExit(f"no node {name!r}; nodes: {[n.name for n in self.nodes]}")

    def save(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        with open(STATE, "w") as f:
            json.dump([asdict(n) for n in self.nodes], f, indent=1)

    @classmethod
    def load(cls) -> "ClusterState":
        if not os.path.exists(STATE):
            return cls()
        with open(STATE) as f:
            return cls([Node(**n) for n in json.load(f)])


def sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"{cmd}: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _link(node: Node) -> None:
    """The node's namespace, its veth on the bridge and its address."""
    sh(f"ip netns add {node.netns}")
    sh(f"ip link add {node.veth} mtu 65000 type veth peer name eth0 mtu 65000 netns {node.netns}")
    sh(f"ip link set {node.veth} master {BRIDGE} up")
    ns = f"ip netns exec {node.netns}"
    sh(f"{ns} ip addr add {node.ip}/24 dev eth0")
    sh(f"{ns} ip link set eth0 up")
    sh(f"{ns} ip link set lo up")
    sh(f"{ns} ip route add default via {GATEWAY}")


def _start(node: Node, head_ip: str, python: str, env: dict[str, str] | None = None) -> int:
    """Start the node: PID namespace whose PID 1 is ``ray start --block``, its own tmpfs on /dev/shm. Returns the
    host PID of that PID 1."""
    os.makedirs(node.temp_dir, exist_ok=True)
    ray = os.path.join(os.path.dirname(python), "ray")
    resources = json.dumps({f"node:{node.name}": 1.0, **node.resources})
    common = (f"--block --node-ip-address={node.ip} --temp-dir={node.temp_dir} {NODE_PORTS} "
              f"--resources={shlex.quote(resources)} --disable-usage-stats")
    if node.name == "head":
        start = f"{ray} start --head --port={RAY_PORT} --include-dashboard=false {common}"
    else:
        start = f"{ray} start --address={head_ip}:{RAY_PORT} {common}"
    inner = f"mount -t tmpfs -o size=4g tmpfs /dev/shm && exec {start}"
    env = {**os.environ, **NODE_ENV, **(env or {}), "RAY_TMPDIR": node.temp_dir,
           **(HEALTH_CHECK if node.name == "head" else {})}
    log = open(os.path.join(STATE_DIR, f"{node.name}.log"), "w")
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node.netns, "unshare", "--mount", "--propagation", "private", "--pid", "--fork",
         "--mount-proc", "sh", "-c", inner],
        stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # ``unshare --fork`` forks PID 1 of the new namespace: that child is the node's init
    for _ in range(100):
        children = sh(f"pgrep -P {proc.pid}", check=False).stdout.split()
        if children:
            return int(children[0])
        if proc.poll() is not None:
            raise RuntimeError(f"node {node.name} exited at start; see {log.name}")
        time.sleep(0.05)
    raise RuntimeError(f"node {node.name}: no PID 1 after 5 s")


def live_nodes(head: Node, python: str) -> int:
    """Nodes the cluster's GCS counts alive, asked from a driver in the head's namespaces (-1: no answer)."""
    probe = (f"import ray; ray.init(address='{head.ip}:{RAY_PORT}', logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    out = run_in(head, [python, "-c", probe], capture=True)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or not last.isdigit():
        print(f"waiting for the cluster: {(out.stderr.strip().splitlines() or ['no answer'])[-1]}", file=sys.stderr)
        return -1
    return int(last)


def _wait_for_nodes(head: Node, count: int, python: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if live_nodes(head, python) >= count:
            return
        time.sleep(2)
    raise RuntimeError(f"the cluster did not reach {count} live nodes in {timeout_s:.0f} s")


def up(workers: int, python: str, resources: list[dict[str, float]] | None = None,
       env: dict[str, str] | None = None) -> ClusterState:
    """Start a head and ``workers`` worker nodes; ``resources[i]`` are node i's custom resources (head first),
    ``env`` extra environment of every node's processes (Ray's workers inherit it)."""
    state = ClusterState.load()
    if state.nodes:
        raise SystemExit(f"a cluster is up ({STATE}); run `down` first")
    shutil.rmtree(STATE_DIR, ignore_errors=True)  # the last run's logs and Ray sessions
    sh(f"ip link add {BRIDGE} type bridge")
    sh(f"ip addr add {GATEWAY}/24 dev {BRIDGE}")
    sh(f"ip link set {BRIDGE} up")
    names = ["head"] + [f"worker{i}" for i in range(1, workers + 1)]
    resources = resources or [{}] * len(names)
    state.nodes = [Node(name, f"{SUBNET}.{10 + i}", resources[i]) for i, name in enumerate(names)]
    state.save()
    for node in state.nodes:
        _link(node)
    head = state.nodes[0]
    for node in state.nodes:
        node.pid = _start(node, head.ip, python, env)
        state.save()
        if node is head:
            _wait_for_nodes(head, 1, python)
    _wait_for_nodes(head, len(state.nodes), python)
    return state


def add_node(state: ClusterState, name: str, python: str, resources: dict[str, float] | None = None,
             env: dict[str, str] | None = None) -> Node:
    """Join a new worker node (a replacement machine) to the running cluster; returns once the GCS counts it."""
    if any(n.name == name for n in state.nodes):
        raise SystemExit(f"node {name!r} exists")
    used = {n.ip for n in state.nodes}
    ip = next(f"{SUBNET}.{i}" for i in range(10, 250) if f"{SUBNET}.{i}" not in used)
    node = Node(name, ip, dict(resources or {}))
    state.nodes.append(node)
    state.save()
    _link(node)
    head = state.node("head")
    alive = live_nodes(head, python)
    node.pid = _start(node, head.ip, python, env)
    state.save()
    _wait_for_nodes(head, alive + 1, python)
    return node


def run_in(node: Node, argv: list[str], capture: bool = False, timeout: float | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` in ``node``'s network, mount and PID namespaces (its IP, its /dev/shm; it dies with the node)."""
    enter = ["nsenter", f"--net=/var/run/netns/{node.netns}"]
    if node.pid:  # its mount namespace's /proc is its PID namespace's: enter both, or psutil cannot find itself
        enter += [f"--mount=/proc/{node.pid}/ns/mnt", f"--pid=/proc/{node.pid}/ns/pid"]
    return subprocess.run(enter + argv, capture_output=capture, text=True, timeout=timeout,
                          env={**os.environ, **NODE_ENV, **(env or {}), "RAY_TMPDIR": node.temp_dir})


DEPLOY = """
import json, sys
import ray
from ray import serve
ray.init(address="{address}", namespace="omni_serve", logging_level="ERROR", log_to_driver=False)
serve.start(http_options={{"host": "0.0.0.0", "port": {port}}}, proxy_location="HeadOnly")
from omni_serve.families.{family} import build_app
serve.run(build_app(json.loads(sys.argv[1])), name="{name}", route_prefix="{route_prefix}")
print("deployed")
"""


def deploy(state: ClusterState, python: str, family: str, args: dict, name: str, route_prefix: str = "/",
           port: int = 8000, env: dict[str, str] | None = None, timeout: float = 900) -> None:
    """``serve.run`` of a family's app from a driver on the head (the app outlives the driver); HTTP on the head's
    IP at ``port``. ``args`` are the graph spec's values (paths absolute: the driver's cwd is not yours)."""
    head = state.node("head")
    code = DEPLOY.format(address=f"{head.ip}:{RAY_PORT}", port=port, family=family, name=name,
                         route_prefix=route_prefix)
    out = run_in(head, [python, "-c", code, json.dumps(args)], capture=True, timeout=timeout, env=env)
    if out.returncode != 0 or "deployed" not in out.stdout:
        raise RuntimeError(f"deploying {family} failed ({out.returncode}):\n{out.stderr[-4000:]}")


def power_off(state: ClusterState, name: str) -> None:
    """SIGKILL the node's PID 1: the kernel kills every process of its PID namespace at once."""
    node = state.node(name)
    if node.pid:
        try:
            os.kill(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.pid = None
    state.save()


def partition(state: ClusterState, name: str, heal: bool = False) -> None:
    """Cut (or restore) the node's link to the bridge: its processes live on but reach no one."""
    node = state.node(name)
    sh(f"ip link set {node.veth} {'up' if heal else 'down'}")
    node.partitioned = not heal
    state.save()


def down() -> None:
    """Remove every node, namespace and the bridge: by the recorded PIDs and by name (a crashed run included)."""
    state = ClusterState.load()
    for node in state.nodes:
        if node.pid:
            try:
                os.kill(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for ns in sh("ip netns list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(PREFIX):
            # any process left in the namespace (a driver, a client) goes with it
            for pid in sh(f"ip netns pids {name}", check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh(f"ip netns del {name}", check=False)
    # A namespace outlives `ip netns del` while a dying process still holds it, and its veth with it: remove the
    # host ends by name (which removes their peers), after the nodes' processes are gone.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(n.pid and os.path.exists(f"/proc/{n.pid}") for n in state.nodes):
        time.sleep(0.1)
    for line in sh("ip -o link show", check=False).stdout.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if name.startswith(f"{PREFIX}v-"):
            sh(f"ip link del {name}", check=False)
    sh(f"ip link del {BRIDGE}", check=False)
    if os.path.exists(STATE):
        os.remove(STATE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start a head and worker nodes")
    u.add_argument("--workers", type=int, default=2)
    u.add_argument("--resources", default=None, help="JSON list of each node's custom resources, head first")
    u.add_argument("--python", default=sys.executable, help="the interpreter whose ray to start (default: this one)")
    sub.add_parser("status", help="the nodes, their IPs and PIDs")
    e = sub.add_parser("exec", help="run a command in a node's namespaces")
    e.add_argument("node")
    e.add_argument("command", nargs=argparse.REMAINDER)
    j = sub.add_parser("join", help="join a new worker node (a replacement machine)")
    j.add_argument("node")
    j.add_argument("--resources", default="{}", help="its custom resources, JSON")
    j.add_argument("--python", default=sys.executable)
    d = sub.add_parser("deploy", help="serve.run a family's app from a driver on the head (HTTP on its IP)")
    d.add_argument("family")
    d.add_argument("args", nargs="?", default="{}", help="graph spec values, JSON (absolute paths)")
    d.add_argument("--name", default=None, help="application name (default: the family)")
    d.add_argument("--route-prefix", default="/")
    d.add_argument("--port", type=int, default=8000)
    d.add_argument("--python", default=sys.executable)
    for name in ("power-off", "partition", "heal"):
        sub.add_parser(name, help=f"{name} a node").add_argument("node")
    sub.add_parser("down", help="tear everything down")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network and mount namespaces)", file=sys.stderr)
        return 2
    if args.cmd == "up":
        try:
            up(args.workers, args.python, json.loads(args.resources) if args.resources else None)
        except BaseException:
            down()
            raise
        args.cmd = "status"
    state = ClusterState.load()
    if args.cmd == "status":
        for n in state.nodes:
            alive = n.pid is not None and os.path.exists(f"/proc/{n.pid}")
            print(f"{n.name:8s} {n.ip:12s} pid {n.pid} {'up' if alive else 'off'}"
                  f"{' partitioned' if n.partitioned else ''}")
    elif args.cmd == "exec":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return run_in(state.node(args.node), command).returncode
    elif args.cmd == "deploy":
        deploy(state, args.python, args.family, json.loads(args.args), args.name or args.family, args.route_prefix,
               args.port)
    elif args.cmd == "join":
        add_node(state, args.node, args.python, json.loads(args.resources))
    elif args.cmd == "power-off":
        power_off(state, args.node)
    elif args.cmd in ("partition", "heal"):
        partition(state, args.node, heal=args.cmd == "heal")
    elif args.cmd == "down":
        down()
    return 0


if __name__ == "__main__":
    sys.exit(main())
