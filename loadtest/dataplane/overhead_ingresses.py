"""The ingresses that `python -m loadtest.dataplane.overhead` measures path A through: the fleet's own, and more on ports of
their own in front of the same balancer and worker (several processes sharing a port, or one that sends each
worker its request itself); and two floors: the HTTP floor, a server that answers from memory
(loadtest/dataplane/http_floor.py), and the path floor, the ingress path's hops with no kvlane work in them
(loadtest/dataplane/path_floor.py)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psutil

from launch.fleet import Fleet
from launch.launcher import Launcher, LaunchError, Process, free_port, wait_ready
from shared.runner import READY_EVENT

HOST = "127.0.0.1"


@dataclass
class IngressUnderTest:
    """One ingress that path A runs through: `processes` processes sharing the port of `base_url`."""

    name: str  # its path's name in the results: "ingress" (the fleet's), "ingress-2p"...
    processes: int
    base_url: str
    process: Process  # the first of its processes, which starts the others
    sends: bool = False  # it sends each worker its request itself (`ingress.balancer_hands_over = false`)
    floor: str = ""  # set for a floor rather than an ingress: what it is, as the report labels it
    helpers: Sequence[Process] = ()  # processes of its own behind it (the path floor's relay)

    def measured(self) -> list[Any]:
        """Its processes for the CPU meter: the first, then the others as `<name>/<k>`, then its helpers."""
        others = psutil.Process(self.process.pid).children()
        return [self.process, *(_Measured(f"{self.name}/{k}", child.pid) for k, child in enumerate(others, 1)), *self.helpers]


@dataclass
class _Measured:
    """A process the CPU meter reads that no launcher `Process` stands for (an ingress's other processes)."""

    name: str
    pid: int


def with_ingress_totals(run: dict[str, Any], ingresses: Sequence[IngressUnderTest]) -> None:
    """Add `<name> (all)`: the CPU of all of an ingress's processes together, for those of several."""
    for ingress in ingresses:
        if ingress.processes == 1:
            continue
        for key in ("cpu_percent", "cpu_ms_per_request"):
            values = [v for name, v in run[key].items() if name == ingress.name or name.startswith(f"{ingress.name}/")]
            run[key][f"{ingress.name} (all)"] = None if not values or None in values else sum(values)


def start_ingress(launcher: Launcher, fleet: Fleet, processes: int, timeout_s: float, sends: bool = False) -> IngressUnderTest:
    """One more ingress of `processes` processes, on a port of its own, in front of the fleet's balancer and worker;
    with `sends`, one that sends each worker its request itself."""
    name, ingress_id = ("ingress-sends", "isends") if sends else (f"ingress-{processes}p", f"i{processes}p")
    port = free_port()
    env = fleet.service_env("ingress", name) | {
        "KVLANE__INGRESS__PORT": str(port), "KVLANE__INGRESS__PROCESSES": str(processes),
        "KVLANE__INGRESS__INGRESS_ID": json.dumps(ingress_id),
        "KVLANE__INGRESS__BALANCER_HANDS_OVER": json.dumps(not sends),
    }
    ingress = IngressUnderTest(name, processes, f"http://{HOST}:{port}", launcher.start_service("ingress", env, name=name),
                               sends=sends)
    wait_ready(ingress.base_url, timeout_s, [ingress.process])
    wait_all_serving(ingress, timeout_s)
    return ingress


def start_http_floor(launcher: Launcher, timeout_s: float) -> IngressUnderTest:
    """The HTTP floor (loadtest/dataplane/http_floor.py) on a port of its own, measured as path A like an ingress."""
    port = free_port()
    process = launcher.spawn("http-floor", [sys.executable, "-m", "loadtest.dataplane.http_floor", "--host", HOST, "--port", str(port)])
    launcher.wait_port(process, port, timeout_s)
    return IngressUnderTest("http-floor", 1, f"http://{HOST}:{port}", process, floor="aiohttp alone, answered from memory")


def start_path_floor(launcher: Launcher, fleet: Fleet, worker_id: str, timeout_s: float,
                     relayed: bool = True) -> IngressUnderTest:
    """The path floor (loadtest/dataplane/path_floor.py) in front of `worker_id`: its front on a port of its own, and its relay
    in the balancer's place; or, not `relayed`, a front that routes by itself (`path-floor-1`, one process)."""
    config = fleet.config
    name = "path-floor" if relayed else "path-floor-1"
    routing = ["--redis", config.redis.url, "--worker", worker_id]
    relay = [launcher.spawn(f"{name}-relay", [sys.executable, "-m", "loadtest.dataplane.path_floor", "relay", "--nats", config.nats.url,
                                              *routing])] if relayed else []
    port = free_port()
    front = launcher.spawn(name, [sys.executable, "-m", "loadtest.dataplane.path_floor", "front", "--host", HOST, "--port", str(port),
                                  "--nats", config.nats.url, *([] if relayed else routing)])
    launcher.wait_port(front, port, timeout_s)
    floor = "its hops and messages, no kvlane work" if relayed else "the same, routed in the front: no balancer hop"
    return IngressUnderTest(name, 1, f"http://{HOST}:{port}", front, floor=floor, helpers=relay)


def wait_all_serving(ingress: IngressUnderTest, timeout_s: float) -> None:
    """Until each of the ingress's processes has said it serves (they share one log)."""
    deadline = time.monotonic() + timeout_s
    while ingress.process.log_path.read_text(errors="replace").count(f'"event": "{READY_EVENT}"') < ingress.processes:
        if not ingress.process.alive() or time.monotonic() > deadline:
            raise LaunchError(f"{ingress.name}: not all {ingress.processes} processes serve:\n{ingress.process.log_tail()}")
        time.sleep(0.1)
