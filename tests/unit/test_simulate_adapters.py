"""`kvlane simulate --adapters`: sessions with LoRA adapters, nodes with adapter slots, loads reported and bounded."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from launch.fleet import with_overrides
from launch.fleet_mix import fleet_nodes, parse_fleet
from loadtest.bench.driver import DriveLimits
from loadtest.bench.run import policy_sections
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec, sessions
from loadtest.simulation.ceiling import PrefixOracle, Served
from loadtest.simulation.command import main as simulate_main
from loadtest.simulation.world import Simulation, SimulationSpec
from shared.config import KvlaneConfig
from shared.kv.block_hash import adapter_root, chained_block_hashes

H100 = "h100-80g-llama3-8b"
COMMON = ["--workers", "4", "--rate", "20", "--requests", "160", "--groups", "4", "--system-tokens", "256",
          "--adapters", "16", "--adapter-popularity", "zipf:1.1", "--quiet"]


def test_simulate_reports_adapter_loads_per_1000_requests_and_bounds_them(tmp_path: Path) -> None:
    argv = [*COMMON, "--policies", "jffc_per_request,round_robin", "--ceiling", "--out", str(tmp_path)]
    assert simulate_main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["parameters"]["fleet"]["lora"]["max_loras"] == 4  # the default with --adapters
    assert results["parameters"]["workload"]["adapters"] == 16
    for run in results["runs"]:
        adapters, requests = run["adapters"], len(run["records"])
        assert adapters["loads"] > 0
        assert adapters["loads_per_1k"] == pytest.approx(1000.0 * adapters["loads"] / requests)
        # Every adapter a request ran with was loaded on some node at least once.
        assert adapters["loads"] >= run["ceiling"]["adapter_loads"]
    aware, round_robin = results["runs"]
    # The ceiling counts each adapter's first load, whichever policy served the requests.
    assert aware["ceiling"] == round_robin["ceiling"]
    assert 1 <= aware["ceiling"]["adapter_loads"] <= 16
    # Costing the loads keeps requests where their adapter is: fewer loads than round robin's.
    assert aware["adapters"]["loads"] < round_robin["adapters"]["loads"]


def test_the_ceiling_falls_with_the_cost_of_a_load(tmp_path: Path) -> None:
    ceilings = []
    for load_s in (0.0, 0.5):
        config = tmp_path / f"load-{load_s}.toml"
        config.write_text(f"[worker.sim]\nadapter_load_s = {load_s}\n")
        out = tmp_path / f"out-{load_s}"
        assert simulate_main([*COMMON, "--policies", "round_robin", "--ceiling", "--config", str(config),
                              "--out", str(out)]) == 0
        (run,) = json.loads((out / "results.json").read_text())["runs"]
        ceilings.append(run["ceiling"]["requests_per_s"])
    assert ceilings[1] < ceilings[0]


def test_adapters_on_a_disaggregated_fleet_alone_exit_2(tmp_path: Path) -> None:
    # Adapters run on aggregated nodes. (Each LoRA option's own checks: tests/unit/test_bench_lora.py.)
    argv = ["--adapters", "4", "--prefill", f"{H100}:1", "--decode", f"{H100}:1"]
    assert simulate_main([*argv, "--rate", "1", "--requests", "2", "--out", str(tmp_path), "--quiet"]) == 2


class Recording(PrefixOracle):
    """Keeps what the simulated ingress prepared for each request that ended."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.prepared: list[tuple[str, list[int], list[int]]] = []

    def ended(self, request_id: str, scheduled_s: float, prompt_token_ids: Sequence[int], block_hashes: Sequence[int],
              output: Sequence[int], adapter: str = "") -> Served:
        self.prepared.append((adapter, list(prompt_token_ids), list(block_hashes)))
        return super().ended(request_id, scheduled_s, prompt_token_ids, block_hashes, output, adapter)


def simulation(adapters: int, max_loras: int = 2) -> Simulation:
    lora = {"worker.lora": {"max_loras": max_loras}} if adapters else {}
    config = with_overrides(with_overrides(KvlaneConfig(), **policy_sections("jffc_per_request")),
                            **{"worker.sim": {"profile": H100}, **lora})
    workload = WorkloadSpec(kind="shared-prefix", seed=5, max_requests=120, groups=3, system_tokens=128,
                            arrival=ArrivalSpec(mode="poisson", rate=15.0), adapters=adapters, adapter_zipf=1.1)
    spec = SimulationSpec(config, tuple(fleet_nodes(parse_fleet(f"{H100}:3"))), workload,
                          DriveLimits(issue_for_s=300.0, hard_stop_s=400.0), 120.0, check_invariants=True)
    return Simulation(spec, oracle=Recording(config.worker.sim.block_size))


def test_nodes_hold_adapters_in_slots_and_say_so_in_their_heartbeats() -> None:
    sim = simulation(adapters=8)
    result = sim.run()
    assert all(r.ok for r in result.records)
    nodes = list(sim.nodes.values())
    # The run's loads are the nodes' schedulers' loads.
    assert result.counters["adapter_loads"] == sum(n.scheduler.stats().adapter_loads for n in nodes) > 0
    for node in nodes:
        assert node.registration.max_loras == 2 and node.registration.max_cpu_loras == 2
        stats = node.heartbeat().stats
        assert 0 < len(stats.adapters_active) <= 2
        assert set(stats.adapters_active) <= {f"adapter-{k}" for k in range(8)}
    # Each prompt's blocks chain from its adapter's root, as ingress computes them.
    oracle = sim._oracle
    assert isinstance(oracle, Recording) and oracle.prepared
    block_size = sim.nodes["w0"].registration.block_size
    for adapter, prompt, hashes in oracle.prepared:
        assert adapter.startswith("adapter-")
        assert hashes == chained_block_hashes(prompt, block_size, adapter_root(adapter))


def test_without_adapters_nodes_serve_none_and_nothing_is_loaded() -> None:
    sim = simulation(adapters=0)
    result = sim.run()
    assert result.counters["adapter_loads"] == 0
    assert all(node.registration.max_loras == 0 for node in sim.nodes.values())
    oracle = sim._oracle
    assert isinstance(oracle, Recording)
    assert all(adapter == "" and hashes == chained_block_hashes(prompt, 16) for adapter, prompt, hashes in oracle.prepared)


def test_sessions_draw_their_adapter_from_a_seeded_zipf_law() -> None:
    spec = WorkloadSpec(kind="multi-turn", seed=2, max_requests=8000, turns=2, adapters=8, adapter_zipf=1.1)
    drawn = [s.adapter for s in sessions(spec)]
    assert drawn == [s.adapter for s in sessions(spec)]  # the same seed, the same adapters
    counts = Counter(drawn)
    assert set(counts) == {f"adapter-{k}" for k in range(8)}
    # Rank k + 1 weighs 1 / (k + 1)^1.1: adapter-0 about 2.1x adapter-1 and 9.9x adapter-7.
    assert counts["adapter-0"] / counts["adapter-1"] == pytest.approx(2 ** 1.1, rel=0.15)
    assert counts["adapter-0"] / counts["adapter-7"] == pytest.approx(8 ** 1.1, rel=0.3)
    uniform = Counter(s.adapter for s in sessions(WorkloadSpec(**{**spec.__dict__, "adapter_zipf": 0.0})))
    assert max(uniform.values()) / min(uniform.values()) < 1.3
    assert {s.adapter for s in sessions(WorkloadSpec(kind="multi-turn", max_requests=10))} == {""}
