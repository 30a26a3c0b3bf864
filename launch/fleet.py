"""A kvlane fleet on one machine: NATS and Redis (started unless reachable),
one balancer, N workers and one ingress, all configured from one config."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from contracts.messages import WorkerRole
from launch.fleet_mix import FleetNode
from launch.launcher import Launcher, Process, free_port, local_port, url_reachable, wait_ready, wait_services_ready
from launch.nats_cluster import NatsNode, start_cluster
from shared.config import KvlaneConfig, to_env

if TYPE_CHECKING:
    from launch.secure import Security

# The permission role (launch/permissions.py) of each kind of worker.
WORKER_ROLES = {"aggregated": "worker", "prefill": "prefill-worker", "decode": "decode-worker"}


@dataclass
class Fleet:
    launcher: Launcher
    config: KvlaneConfig
    base_url: str
    servers: list[Process] = field(default_factory=list)
    balancers: list[Process] = field(default_factory=list)
    cache_managers: list[Process] = field(default_factory=list)
    health_probers: list[Process] = field(default_factory=list)
    workers: list[Process] = field(default_factory=list)
    ingress: Process | None = None
    autoscalers: list[Process] = field(default_factory=list)
    # Each worker process's role, by process name.
    roles: dict[str, WorkerRole] = field(default_factory=dict)
    # `kvlane up --secure`: each process gets its own credentials from here.
    security: Security | None = None
    # `kvlane up --nats-cluster N`: the clustered nats-servers, with their monitoring ports.
    nats_nodes: list[NatsNode] = field(default_factory=list)

    def service_env(self, role: str, instance_id: str) -> dict[str, str]:
        """The environment of one service process: the config, and with `security` its own credentials."""
        env = to_env(self.config)
        if self.security is not None:
            env |= self.security.env(role, instance_id)
        return env

    def add_worker(self, worker_id: str, role: WorkerRole = "aggregated", kind: FleetNode | None = None) -> Process:
        """Start one worker; a prefill or decode worker runs as its own service.

        `kind` gives a sim worker its own profile and a fraction of the configured speed (a mixed fleet).
        """
        env = self.service_env(WORKER_ROLES[role], worker_id) | {"KVLANE__WORKER__WORKER_ID": f'"{worker_id}"'}
        if self.config.worker.metrics_port:
            # Workers on one host cannot share a port: each takes the next one up.
            env["KVLANE__WORKER__METRICS_PORT"] = str(self.config.worker.metrics_port + len(self.roles))
        if kind is not None:
            sim = self.config.worker.sim
            env |= {"KVLANE__WORKER__SIM__PROFILE": f'"{kind.profile}"', "KVLANE__WORKER__SIM__SPEED": repr(sim.speed * kind.speed)}
        service = "worker" if role == "aggregated" else f"{role}_worker"
        process = self.launcher.start_service(service, env, name=f"worker-{worker_id}")
        self.workers.append(process)
        self.roles[process.name] = role
        return process

    def drain_worker(self, process: Process) -> None:
        """Ask a worker to finish what it runs and leave (SIGTERM); it no longer counts as one of the fleet's."""
        self.workers.remove(process)
        process.signal(signal.SIGTERM)

    def add_autoscaler(self) -> Process:
        index = len(self.autoscalers)
        process = self.launcher.start_service("autoscaler", self.service_env("autoscaler", str(index)), name=f"autoscaler-{index}")
        self.autoscalers.append(process)
        return process

    def add_balancer(self) -> Process:
        index = len(self.balancers)
        process = self.launcher.start_service("balancer", self.service_env("balancer", str(index)), name=f"balancer-{index}")
        self.balancers.append(process)
        return process

    def add_cache_manager(self) -> Process:
        index = len(self.cache_managers)
        process = self.launcher.start_service("cache_manager", self.service_env("cache-manager", str(index)), name=f"cache-manager-{index}")
        self.cache_managers.append(process)
        return process

    def services(self) -> list[Process]:
        return [*self.balancers, *self.cache_managers, *self.health_probers, *self.workers, *self.autoscalers,
                *([self.ingress] if self.ingress else [])]

    def stop(self) -> None:
        self.launcher.stop_all()
        if self.security is not None:
            self.security.close()


def ensure_servers(launcher: Launcher, config: KvlaneConfig) -> list[Process]:
    """Start nats-server and redis-server for the configured URLs unless they answer already."""
    started = []
    nats_url = config.nats.servers()[0]  # of several, kvlane starts the first
    if not url_reachable(nats_url):
        # With JetStream: workers publish their tokenizers to its object store (shared/model_store.py).
        jetstream = ["-js", "-sd", str(launcher.log_dir / "jetstream")]
        started.append(launcher.start_nats(local_port(nats_url), extra_args=jetstream))
    if not url_reachable(config.redis.url):
        started.append(launcher.start_redis(local_port(config.redis.url)))
    return started


def start_nats_cluster(launcher: Launcher, config: KvlaneConfig, size: int) -> tuple[list[NatsNode], KvlaneConfig]:
    """`size` clustered nats-servers on the configured ports (free ones for the rest); the config names them all."""
    urls = config.nats.servers()[:size]
    for url in urls:
        if url_reachable(url):
            raise ValueError(f"a clustered NATS is one kvlane starts itself, but {url} answers already: "
                             "point nats.url at free ports (several, comma-separated, or one for the first server)")
    ports = [local_port(url) for url in urls]
    ports += [free_port() for _ in range(size - len(ports))]
    nodes = start_cluster(launcher, ports, launcher.log_dir / "jetstream")
    return nodes, with_overrides(config, nats={"url": ",".join(node.url for node in nodes)})


def start_fleet(
    launcher: Launcher,
    config: KvlaneConfig,
    workers: int,
    ready_timeout: float = 60.0,
    health_prober: bool = True,
    prefill_workers: int = 0,
    decode_workers: int = 0,
    mix: Sequence[FleetNode] = (),
    security: Security | None = None,
    nats_cluster: int = 1,
    cache_managers: int = 1,
) -> Fleet:
    """Servers, routing, then `workers` aggregated workers (w0, w1...), prefill
    workers (p0...) and decode workers (d0...), then ingress; returns once all serve.

    With `mix`, the aggregated workers are those nodes, each with its own sim profile and speed.
    With `security` (`kvlane up --secure`), the servers it starts require credentials and
    every process gets its own. With `nats_cluster` > 1, that many clustered nats-servers
    (launch/nats_cluster.py), and every service gets all their URLs. `cache_managers`
    replicas of the cache-manager share its work (with `balancer.allocate_kv`).
    """
    if cache_managers < 1:
        raise ValueError(f"cache_managers must be at least 1, not {cache_managers}")
    if mix:
        workers = len(mix)
    host = "127.0.0.1" if config.ingress.host in ("0.0.0.0", "") else config.ingress.host
    fleet = Fleet(launcher, config, f"http://{host}:{config.ingress.port}", security=security)
    pools = (("w", "aggregated", workers), ("p", "prefill", prefill_workers), ("d", "decode", decode_workers))
    prober_id, ingress_id = config.health.prober_id or "h0", config.ingress.ingress_id or "i0"
    try:
        if security is not None:
            # Every planned process's user is in the servers' first configuration: no reload while they connect.
            for role, instance_id in [
                ("balancer", "0"), *(("cache-manager", str(index)) for index in range(cache_managers)),
                ("health-prober", prober_id), ("ingress", ingress_id),
                *((WORKER_ROLES[role], f"{prefix}{index}") for prefix, role, count in pools for index in range(count)),
            ]:
                security.account(role, instance_id)
            fleet.servers, config = security.start_servers(launcher, config)
            fleet.config = config
        elif nats_cluster > 1:
            fleet.nats_nodes, config = start_nats_cluster(launcher, config, nats_cluster)
            fleet.config = config
            fleet.servers = [node.process for node in fleet.nats_nodes if node.process is not None]
            fleet.servers += ensure_servers(launcher, config)  # Redis, the cluster answering already
        else:
            fleet.servers = ensure_servers(launcher, config)
        fleet.balancers.append(launcher.start_service("balancer", fleet.service_env("balancer", "0")))
        if config.balancer.allocate_kv:
            for _ in range(cache_managers):
                fleet.add_cache_manager()
        if health_prober:
            prober = fleet.service_env("health-prober", prober_id)
            fleet.health_probers.append(launcher.start_service("health_prober", prober, name="health-prober"))
        # Routing must be up before the first request can arrive.
        wait_services_ready([*fleet.balancers, *fleet.cache_managers], ready_timeout)
        kinds = {node.worker_id: node for node in mix}
        for prefix, role, count in pools:
            for index in range(count):
                worker_id = f"{prefix}{index}"
                fleet.add_worker(worker_id, role, kinds.get(worker_id))
        fleet.ingress = launcher.start_service("ingress", fleet.service_env("ingress", ingress_id))
        # A sim worker process may host several nodes (worker.nodes), each a worker to /ready.
        nodes = (workers + prefill_workers + decode_workers) * config.worker.nodes
        wait_ready(fleet.base_url, ready_timeout, fleet.services(), min_workers=nodes)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def with_overrides(config: KvlaneConfig, **sections: dict) -> KvlaneConfig:
    """A copy of `config` with some fields of some sections replaced."""
    data = msgspec.to_builtins(config)
    for section, values in sections.items():
        node = data
        for part in section.split("."):
            node = node[part]
        node.update(values)
    return msgspec.convert(data, KvlaneConfig)
