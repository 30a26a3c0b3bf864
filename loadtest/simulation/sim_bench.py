"""What the virtual-time benchmarks share: a plain fleet's simulation spec, and how much one fleet serves."""

from __future__ import annotations

from typing import Any

from launch.fleet import with_overrides
from launch.fleet_mix import FleetNode
from loadtest.bench.run import FleetSpec
from loadtest.bench.driver import DriveLimits
from loadtest.simulation.command import simulation_config
from loadtest.simulation.world import Simulation, SimulationSpec
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec
from shared.config import AutoscalerSettings, KvlaneConfig

REQUEST_TIMEOUT_S = 120.0


def sim_spec(
    profile: str,
    nodes: int,
    workload: WorkloadSpec,
    issue_for_s: float,
    *,
    concurrency: int | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    autoscaling: AutoscalerSettings | None = None,
    node_start_s: float = 5.0,
) -> SimulationSpec:
    """`nodes` aggregated nodes of `profile` under the default policy, the live bench's settings plus `overrides`."""
    fleet = FleetSpec(workers=nodes, profile=profile, seed=workload.seed)
    config = with_overrides(simulation_config(KvlaneConfig(), fleet, "jffc_per_request", REQUEST_TIMEOUT_S), **(overrides or {}))
    limits = DriveLimits(issue_for_s=issue_for_s, hard_stop_s=issue_for_s + REQUEST_TIMEOUT_S + 5.0, concurrency=concurrency)
    kinds = tuple(FleetNode(f"w{i}", profile, 1.0) for i in range(nodes))
    return SimulationSpec(config, kinds, workload, limits, REQUEST_TIMEOUT_S, autoscaling=autoscaling, node_start_s=node_start_s)


def capacity_rps(profile: str, nodes: int, workload: WorkloadSpec, seconds: float = 60.0) -> float:
    """Requests per second `nodes` nodes complete when kept busy (a closed loop twice their slots deep)."""
    slots = simulation_config(KvlaneConfig(), FleetSpec(workers=1, profile=profile), "jffc_per_request",
                              REQUEST_TIMEOUT_S).worker.sim.max_num_seqs
    closed = WorkloadSpec(**{**workload.__dict__, "arrival": ArrivalSpec(mode="closed"), "max_requests": 1_000_000,
                             "duration_s": seconds})
    result = Simulation(sim_spec(profile, nodes, closed, seconds, concurrency=2 * slots * nodes)).run()
    return sum(1 for r in result.records if r.ok) / result.simulated_s
