"""A NATS cluster on one machine: several nats-servers routed to each other,
with JetStream (the model-files object store) replicated across them.

`kvlane up --nats-cluster N` and the cluster fault tests start one. Each
server gets a client port, a cluster (route) port, a monitoring port (`-m`,
whose `/routez`, `/connz` and `/healthz` tell when the cluster has formed
and who is connected where) and a JetStream store directory of its own.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launch.launcher import LaunchError, Launcher, Process, free_port

CLUSTER_NAME = "kvlane"


@dataclass
class NatsNode:
    name: str
    client_port: int
    cluster_port: int
    monitor_port: int
    process: Process | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.client_port}"

    def monitor(self, endpoint: str, timeout: float = 2.0) -> dict:
        """One monitoring endpoint's JSON (`routez`, `connz`, `healthz`...)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/{endpoint}", timeout=timeout) as response:
            return json.loads(response.read())

    def connection_names(self) -> list[str]:
        """The client names (kvlane-<service>-<id>) connected to this server now."""
        return [conn.get("name", "") for conn in self.monitor("connz?limit=1024").get("connections") or []]


def plan_cluster(client_ports: list[int]) -> list[NatsNode]:
    """One node per client port, each with free route and monitoring ports."""
    return [NatsNode(f"nats-{index}", port, free_port(), free_port()) for index, port in enumerate(client_ports)]


def server_args(node: NatsNode, nodes: list[NatsNode], store_dir: Path) -> list[str]:
    """nats-server flags for `node`: routes to every other node, JetStream in a directory of its own."""
    routes = ",".join(f"nats://127.0.0.1:{other.cluster_port}" for other in nodes if other is not node)
    args = ["--server_name", node.name, "-m", str(node.monitor_port), "-js", "-sd", str(store_dir / node.name)]
    if len(nodes) > 1:
        args += ["--cluster_name", CLUSTER_NAME, "--cluster", f"nats://127.0.0.1:{node.cluster_port}", "--routes", routes]
    return args


def start_cluster(launcher: Launcher, client_ports: list[int], store_dir: Path, timeout: float = 30.0) -> list[NatsNode]:
    """Start one nats-server per port, routed to each other; returns once every route is up and JetStream answers."""
    nodes = plan_cluster(client_ports)
    try:
        for node in nodes:
            node.process = launcher.start_nats(node.client_port, name=node.name, extra_args=server_args(node, nodes, store_dir))
        wait_cluster_formed(nodes, timeout)
    except BaseException:
        for node in nodes:
            if node.process is not None:
                node.process.stop()
        raise
    return nodes


def wait_cluster_formed(nodes: list[NatsNode], timeout: float = 30.0) -> None:
    """Until every live node routes to all the others and reports healthy (JetStream's meta leader elected)."""
    deadline = time.monotonic() + timeout
    waiting_for = ""
    while True:
        waiting_for = _not_formed(nodes)
        if not waiting_for:
            return
        for node in nodes:
            if node.process is not None and not node.process.alive():
                raise LaunchError(f"{node.name} exited with {node.process.popen.returncode}:\n{node.process.log_tail()}")
        if time.monotonic() > deadline:
            raise LaunchError(f"the NATS cluster did not form within {timeout:.0f}s: {waiting_for}")
        time.sleep(0.1)


def _not_formed(nodes: list[NatsNode]) -> str:
    """What the cluster still waits for ('' once formed)."""
    for node in nodes:
        try:
            # Distinct peers, not route connections: a server pools several per peer.
            peers = {route.get("remote_id") for route in node.monitor("routez").get("routes") or []}
            if len(peers) < len(nodes) - 1:
                return f"{node.name} routes to {len(peers)} of {len(nodes) - 1} other servers"
            health = node.monitor("healthz")
        except urllib.error.HTTPError as exc:  # /healthz answers 503 until JetStream is ready
            return f"{node.name}: HTTP {exc.code} {exc.read()[:200]!r}"
        except (OSError, ValueError) as exc:
            return f"{node.name}: {exc}"
        if health.get("status") != "ok":
            return f"{node.name}: {health}"
    return ""


def connected_node(nodes: list[NatsNode], name_prefix: str) -> NatsNode | None:
    """The live node a client is connected to now, by the start of its connection name (`kvlane-ingress-`)."""
    for node in nodes:
        if node.process is not None and node.process.alive():
            try:
                if any(name.startswith(name_prefix) for name in node.connection_names()):
                    return node
            except (OSError, ValueError):
                continue
    return None
