"""`kvlane simulate`'s fleet in virtual time: determinism, every request ends once, capacity, failures, mixed fleets."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from launch.fleet import with_overrides
from launch.fleet_mix import NodeKind, fleet_nodes, parse_fleet
from loadtest.bench.command import build_parser as bench_parser, plan_runs
from loadtest.bench.run import fleet_config, policy_sections
from loadtest.bench.client import RequestRecord
from loadtest.bench.driver import DriveLimits
from loadtest.bench.metrics import Slo, summarize
from loadtest.simulation.command import build_parser as simulate_parser, main as simulate_main, node_changes, plan as simulate_plan
from loadtest.simulation.events import EventQueue
from loadtest.simulation.world import NodeChange, Simulation, SimulationResult, SimulationSpec
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec
from services.worker.main import advertised_kv_transfer_of
from shared.config import KvlaneConfig, SimSettings, WorkerSettings

H100 = "h100-80g-llama3-8b"
SLO = Slo(ttft_s=1.0, tpot_s=0.1)


def spec(policy: str = "jffc_per_request", fleet: str = f"{H100}:4", rate: float = 40.0, requests: int = 300,
         kind: str = "shared-prefix", num_blocks: int = 4096, changes: tuple[NodeChange, ...] = (),
         concurrency: int | None = None, overrides: dict[str, dict] | None = None, **workload: object) -> SimulationSpec:
    config = with_overrides(with_overrides(KvlaneConfig(), **policy_sections(policy)),
                            **{"worker.sim": {"profile": H100, "num_blocks": num_blocks}, **(overrides or {})})
    arrival = ArrivalSpec(mode="closed") if concurrency else ArrivalSpec(mode="poisson", rate=rate)
    work = WorkloadSpec(kind=kind, seed=3, max_requests=requests, arrival=arrival, **workload)  # type: ignore[arg-type]
    return SimulationSpec(config, tuple(fleet_nodes(parse_fleet(fleet))), work,
                          DriveLimits(issue_for_s=300.0, hard_stop_s=400.0, concurrency=concurrency), 120.0,
                          changes=changes, check_invariants=True)


def run(simulation_spec: SimulationSpec) -> tuple[SimulationResult, Counter[str], Simulation]:
    """The result, how often each request id ended, and the simulation's final state."""
    ended: Counter[str] = Counter()
    simulation = Simulation(simulation_spec, lambda record: ended.update([record.request_id or ""]))
    return simulation.run(), ended, simulation


def test_event_queue_runs_in_time_order_and_ties_in_scheduling_order() -> None:
    events = EventQueue()
    seen: list[tuple[float, str]] = []
    events.at(2.0, lambda: seen.append((events.now, "late")))
    events.at(1.0, lambda: seen.append((events.now, "first")))
    events.at(1.0, lambda: (seen.append((events.now, "second")), events.after(0.5, lambda: seen.append((events.now, "spawned")))))
    events.run()
    assert seen == [(1.0, "first"), (1.0, "second"), (1.5, "spawned"), (2.0, "late")]
    events.at(0.0, lambda: seen.append((events.now, "past")))  # never before now
    events.run()
    assert seen[-1] == (2.0, "past")


def test_same_seed_gives_identical_records() -> None:
    first, _, _ = run(spec(requests=200))
    second, _, _ = run(spec(requests=200))
    assert json.dumps([r.to_json() for r in first.records]) == json.dumps([r.to_json() for r in second.records])
    assert first.runs == second.runs and first.events == second.events


def test_every_request_ends_exactly_once_under_overload_with_small_kv_caches() -> None:
    # 4x what the fleet serves and KV for a few requests per node: queueing, KV refusals, engine preemption.
    result, ended, simulation = run(spec(rate=400.0, requests=600, num_blocks=400, groups=64))
    records = result.records
    assert len(records) == 600
    assert set(ended) == {r.request_id for r in records} and set(ended.values()) == {1}
    assert all(r.ok or r.error for r in records)
    assert sum(r.ok for r in records) > 300
    # The leases, not the engines, bound KV: placements the ledger refused, none the engine had to preempt.
    assert result.counters["kv_refusals"] > 0
    stats = [node.scheduler.stats() for node in simulation.nodes.values()]
    assert sum(s.preemptions for s in stats) == 0
    assert all(s.running == s.waiting == 0 for s in stats)
    # 64 system prompts over caches of 400 blocks: new prompts evict older ones, and the result counts them.
    assert result.counters["kv_blocks_evicted"] == sum(s.blocks_evicted for s in stats) > 0
    assert len(simulation.balancer.router.table) == 0 and len(simulation.balancer.router.queue) == 0


def test_multi_turn_conversations_carry_their_answers() -> None:
    records = run(spec(kind="multi-turn", requests=40, rate=4.0, turns=4, groups=2))[0].records
    by_conversation: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_conversation.setdefault(record.session_id, []).append(record)
    for turns in by_conversation.values():
        prompts = [r.prompt_tokens or 0 for r in sorted(turns, key=lambda r: r.turn)]
        # Each turn's prompt holds the previous one plus its answer (128 tokens) and a new question.
        assert all(later > earlier + 128 for earlier, later in zip(prompts, prompts[1:]))
    assert all(r.ok for r in records)
    assert sum(r.cached_tokens or 0 for r in records if r.turn > 0) > 0


def test_a_failed_node_s_requests_migrate_and_a_joining_node_takes_work() -> None:
    changes = (NodeChange(3.0, "w1"), NodeChange(5.0, "w4", H100))
    result, ended, simulation = run(spec(rate=40.0, requests=500, changes=changes))
    assert set(ended.values()) == {1} and all(r.ok for r in result.records)
    assert simulation.counters["migrations"] > 0 and simulation.counters["node_failures"] == 1
    per_worker = summarize(result.records, SLO, result.runs)["requests_per_worker"]
    assert per_worker["w4"] > 0
    # Requests that finished on w1 did so before it failed; none was sent there after its heartbeats stopped for good.
    assert max(r.end_s or 0 for r in result.records if result.runs[r.request_id or ""].worker_id == "w1") < 3.0 + 0.1


def test_a_disaggregated_fleet_hands_kv_from_prefill_to_decode_nodes_and_survives_a_prefill_node_failure() -> None:
    base = spec(requests=400, rate=20.0, groups=200)
    nodes = (*fleet_nodes(parse_fleet(f"{H100}:2"), "prefill"), *fleet_nodes(parse_fleet(f"{H100}:2"), "decode"))
    for changes in ((), (NodeChange(4.0, "p0"),)):
        result, ended, simulation = run(dataclasses.replace(base, nodes=nodes, changes=changes))
        assert set(ended.values()) == {1} and all(r.ok for r in result.records)
        assert simulation.counters["kv_hand_offs"] > 100
        # Decode nodes stream every answer; prefill nodes only compute prompts.
        assert {run.worker_id for run in result.runs.values()} == {"d0", "d1"}
        assert all(node.scheduler.held_blocks == 0 for node in simulation.nodes.values() if node.alive)
    assert simulation.counters["node_failures"] == 1


def test_kv_share_nodes_pull_a_busy_nodes_prefix_and_survive_a_source_failure() -> None:
    """Under load, requests whose prefix a busy node caches run elsewhere on the pulled prefix; a source that fails
    mid-run loses no request. Without kv_share, nothing is pulled."""
    base = spec(rate=60.0, requests=600, groups=64, num_blocks=30000, overrides={"worker": {"kv_share": True}})
    for changes in ((), (NodeChange(3.0, "w0"),)):
        result, ended, simulation = run(dataclasses.replace(base, changes=changes))
        assert set(ended.values()) == {1} and all(r.ok for r in result.records)
        assert simulation.counters["prefix_pulls"] > 50 and simulation.counters["prefix_pull_tokens"] > 0
        assert simulation.counters["kv_hand_offs"] == 0
        # Every node keeps its held blocks for no longer than the pulls: none is left held at the end.
        assert all(node.scheduler.held_blocks == 0 for node in simulation.nodes.values() if node.alive)
    result, ended, simulation = run(dataclasses.replace(base, config=with_overrides(base.config, worker={"kv_share": False})))
    assert all(r.ok for r in result.records) and simulation.counters["prefix_pulls"] == 0


def test_simulated_nodes_advertise_their_kv_link_as_a_live_sim_worker_does() -> None:
    base = spec(requests=20, rate=20.0, overrides={"worker.sim": {"profile": H100, "kv_link": "ethernet-25g"}})
    nodes = (*fleet_nodes(parse_fleet(f"{H100}:1"), "prefill"), *fleet_nodes(parse_fleet(f"{H100}:1"), "decode"))
    result, _, simulation = run(dataclasses.replace(base, nodes=nodes))
    assert all(r.ok for r in result.records)
    live = advertised_kv_transfer_of(WorkerSettings(sim=SimSettings(profile=H100, kv_link="ethernet-25g")))
    assert live is not None and live.link_bytes_per_s == 3.125e9
    assert {w: node.registration.kv_transfer for w, node in simulation.nodes.items()} == {"p0": live, "d0": live}


def test_round_robin_loses_to_least_loaded_on_a_fleet_with_stragglers() -> None:
    # Two nodes at a tenth of the speed: a request there misses the TPOT SLO.
    fleet = f"{H100}:2,{H100}@0.1:2"
    summaries = {}
    for policy in ("round_robin", "least_loaded"):
        result = run(spec(policy=policy, fleet=fleet, rate=20.0, requests=1000, groups=16))[0]
        summaries[policy] = summarize(result.records, SLO, result.runs)
    round_robin, least_loaded = summaries["round_robin"], summaries["least_loaded"]
    assert least_loaded["slo_attainment"] > round_robin["slo_attainment"] + 0.1
    assert least_loaded["goodput_rps"] > 1.2 * round_robin["goodput_rps"]
    slow = ("w2", "w3")
    assert sum(least_loaded["requests_per_worker"][w] for w in slow) < sum(round_robin["requests_per_worker"][w] for w in slow)


def test_closed_loop_keeps_the_given_number_of_requests_in_flight() -> None:
    result, ended, _ = run(spec(concurrency=8, requests=100))
    records = result.records
    assert len(records) == 100 and set(ended.values()) == {1}
    events = sorted([(r.sent_s, 1) for r in records] + [(r.end_s or 0.0, -1) for r in records])
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    assert peak == 8


@pytest.mark.parametrize("text, error", [
    ("", "empty"), ("h100-80g-llama3-8b", "PROFILE"), ("h100-80g-llama3-8b:0", "at least 1"),
    ("h100-80g-llama3-8b@0:2", "SPEED positive"), ("h100-80g-llama3-8b:x", "integer"), ("no-such-gpu:2", "unknown"),
])
def test_bad_fleet_values_are_refused_with_the_reason(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_fleet(text)


def test_fleet_values_name_nodes_in_order() -> None:
    kinds = parse_fleet(f"{H100}:2, a100-80g-llama3-8b@0.5:1")
    assert kinds == [NodeKind(H100, 2), NodeKind("a100-80g-llama3-8b", 1, 0.5)]
    assert [(n.worker_id, n.profile, n.speed) for n in fleet_nodes(kinds)] == [
        ("w0", H100, 1.0), ("w1", H100, 1.0), ("w2", "a100-80g-llama3-8b", 0.5)]
    assert [c.worker_id for c in node_changes(["9=w0"], [f"4={H100}@0.5"], 3)] == ["w3", "w0"]
    with pytest.raises(ValueError, match="T=WORKER"):
        node_changes(["w0"], [], 3)


@pytest.mark.parametrize("argv", [
    ["--fleet", "no-such-gpu:2", "--rate", "1"],
    ["--fail", "1=w9", "--rate", "1"],
    ["--rate", "-1"],
    ["--hop-ms", "-1", "--rate", "1"],
    ["--warmup", "5", "--rate", "1"],  # a warm-up needs the --duration it comes before
    ["--warmup", "5", "--duration", "5", "--requests", "10", "--rate", "1"],
    ["--warmup", "-1", "--duration", "5", "--rate", "1"],
    ["--warmup", "nan", "--duration", "5", "--rate", "1"],
    ["--ceiling", "--fail", "1=w0", "--rate", "1"],  # the ceiling bounds a fleet that stays as it is
    ["--ceiling", "--prefill", f"{H100}:1", "--decode", f"{H100}:1", "--rate", "1"],
])
def test_simulate_refuses_bad_options_with_exit_2(argv: list[str], tmp_path: Path) -> None:
    assert simulate_main([*argv, "--out", str(tmp_path), "--quiet"]) == 2


def test_simulate_writes_the_bench_results_layout(tmp_path: Path) -> None:
    argv = ["--policies", "round_robin,jffc", "--rates", "20,40", "--requests", "60", "--out", str(tmp_path), "--quiet"]
    assert simulate_main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["benchmark"] == "kvlane-simulate" and results["parameters"]["fleet"]["workers"] == 4
    assert [(r["policy"], r["rate"]) for r in results["runs"]] == [
        ("round_robin", 20.0), ("jffc", 20.0), ("round_robin", 40.0), ("jffc", 40.0)]
    assert all(r["summary"]["succeeded"] == 60 and r["simulation"]["events"] > 0 for r in results["runs"])
    assert {p.name for p in tmp_path.glob("*.png")} == {"ttft_cdf.png", "goodput.png", "goodput_vs_rate.png"}


def test_a_warm_up_is_served_but_only_the_duration_after_it_is_measured(tmp_path: Path) -> None:
    common = ["--policies", "jffc_per_request", "--rate", "20", "--workload", "shared-prefix", "--groups", "16",
              "--quiet"]
    assert simulate_main([*common, "--duration", "6", "--out", str(tmp_path / "whole")]) == 0
    assert simulate_main([*common, "--duration", "4", "--warmup", "2", "--out", str(tmp_path / "warm")]) == 0
    (whole,) = json.loads((tmp_path / "whole" / "results.json").read_text())["runs"]
    warm_results = json.loads((tmp_path / "warm" / "results.json").read_text())
    (warm,) = warm_results["runs"]
    assert warm_results["parameters"]["warmup_s"] == 2.0
    # The same seed and load: the same arrivals, split at the warm-up's end.
    later = [r for r in whole["records"] if r["scheduled_s"] >= 2.0]
    assert warm["records"] == later and 0 < len(later) < len(whole["records"])
    assert warm["simulation"]["warmup_requests"] == len(whole["records"]) - len(later)
    assert warm["summary"]["requests"] == len(later)
    # Prefixes cached during the warm-up make later requests hit more often than the run's first ones.
    assert warm["summary"]["prefix_cache_hit_rate"] > whole["summary"]["prefix_cache_hit_rate"]


def test_the_ceiling_is_measured_on_the_requests_after_the_warm_up_and_the_same_for_every_policy(tmp_path: Path) -> None:
    argv = ["--policies", "round_robin,jffc_per_request", "--rate", "20", "--workload", "multi-turn", "--groups", "4",
            "--turns", "3", "--think-time", "1", "--duration", "6", "--warmup", "3", "--ceiling", "--quiet",
            "--out", str(tmp_path)]
    assert simulate_main(argv) == 0
    first, second = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert first["ceiling"] == second["ceiling"]  # the same requests, whichever policy served them
    ceiling = first["ceiling"]
    assert ceiling["requests"] == first["summary"]["succeeded"] == len(first["records"])
    assert ceiling["requests_per_session"] == pytest.approx(3.0, abs=0.2)
    assert ceiling["sessions_per_s"] == pytest.approx(ceiling["requests_per_s"] / ceiling["requests_per_session"])
    # Later turns find their history computed: at most the new question and the template stay uncached.
    assert 0.0 < ceiling["uncached_share"] < 0.5
    assert "ceiling" not in json.loads((tmp_path / "results.json").read_text())["runs"][0]["summary"]


def test_a_config_file_sets_the_balancer_of_every_run(tmp_path: Path) -> None:
    path = tmp_path / "kvlane.toml"
    path.write_text("[balancer.jffc_per_request]\nimposed_delay_weight = 4\n")
    common = ["--policies", "jffc_per_request,round_robin", "--rate", "10", "--requests", "5"]
    runs, _ = simulate_plan(simulate_parser().parse_args([*common, "--config", str(path)]))
    assert [run.config.balancer.jffc_per_request.imposed_delay_weight for run in runs] == [4.0, 4.0]
    assert [run.config.balancer.policy for run in runs] == ["jffc_per_request", "round_robin"]
    runs, _ = simulate_plan(simulate_parser().parse_args(common))
    assert {run.config.balancer.jffc_per_request.imposed_delay_weight for run in runs} == {2.0}


def test_kv_share_makes_every_node_kv_share_in_simulate_and_bench(tmp_path: Path) -> None:
    common = ["--policies", "jffc_per_request", "--rate", "10", "--requests", "5"]
    for argv, shared in ((common, False), ([*common, "--kv-share", "--kv-link", "ethernet-25g"], True)):
        runs, _ = simulate_plan(simulate_parser().parse_args(argv))
        assert [run.config.worker.kv_share for run in runs] == [shared]
    assert runs[0].config.worker.sim.kv_link == "ethernet-25g"
    for argv, shared in ((common, False), ([*common, "--kv-share"], True)):
        planned, _ = plan_runs(bench_parser().parse_args(argv), tmp_path)
        assert [fleet_config(run.fleet, run.policy, run.request_timeout_s).worker.kv_share for run in planned] == [shared]
