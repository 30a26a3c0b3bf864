"""A real three-master Redis Cluster on localhost, for tests that must hold in cluster mode too.

Three `redis-server --cluster-enabled yes` processes in a temporary folder,
joined by `redis-cli --cluster create` (no replicas), ready once every node
reports `cluster_state:ok`.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from launch.launcher import free_port

MASTERS = 3
READY_TIMEOUT_S = 30.0
# A cluster node also listens on its port + 10000 (the cluster bus), which must be a port too.
_BUS_OFFSET = 10_000


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def cluster_port() -> int:
    """A free port whose cluster-bus port is free as well."""
    while True:
        port = free_port()
        if port + _BUS_OFFSET <= 65_535 and _port_free(port + _BUS_OFFSET):
            return port


def _wait_until(holds, what: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis Cluster: {what} within {timeout_s:.0f}s")
        time.sleep(0.02)


def _answers(port: int, process: subprocess.Popen, log: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"redis-server on {port} exited: {log.read_text()[-500:]}")
    try:
        return bool(redis.Redis(port=port, socket_timeout=1).ping())
    except redis.ConnectionError:
        return False


def _cluster_ok(port: int) -> bool:
    return redis.Redis(port=port, socket_timeout=1).cluster("INFO").get("cluster_state") == "ok"


@contextmanager
def redis_cluster(folder: Path) -> Iterator[list[int]]:
    """The ports of the cluster's masters while it runs; every process is stopped afterwards."""
    ports: list[int] = []
    while len(ports) < MASTERS:
        port = cluster_port()
        if port not in ports and port + _BUS_OFFSET not in ports and port - _BUS_OFFSET not in ports:
            ports.append(port)
    processes = []
    try:
        for port in ports:
            node_dir = folder / f"redis-{port}"
            node_dir.mkdir(parents=True)
            processes.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(node_dir / "nodes.conf"), "--dir", str(node_dir), "--save", "",
                 "--appendonly", "no"],
                stdout=(node_dir / "redis.log").open("wb"), stderr=subprocess.STDOUT,
            ))
        for port, process in zip(ports, processes, strict=True):
            log = folder / f"redis-{port}" / "redis.log"
            _wait_until(lambda port=port, process=process, log=log: _answers(port, process, log), f"node {port} did not answer")
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=READY_TIMEOUT_S,
        )
        for port in ports:
            _wait_until(lambda port=port: _cluster_ok(port), f"node {port} did not reach cluster_state:ok")
        yield ports
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
