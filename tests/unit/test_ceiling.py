"""The throughput ceiling: its floors hold against the sim scheduler, its dual bound against the exact split."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from launch.fleet import with_overrides
from launch.fleet_mix import fleet_nodes, parse_fleet
from loadtest.bench.run import policy_sections
from loadtest.bench.driver import DriveLimits
from loadtest.simulation.ceiling import NodeCost, PrefixOracle, Served, request_seconds, throughput_ceiling
from loadtest.simulation.world import Simulation, SimulationSpec
from loadtest.bench.workloads import ArrivalSpec, WorkloadSpec
from services.worker.sim import SimRequest
from services.worker.sim.scheduler import SimScheduler
from shared.kv.block_hash import chained_block_hashes
from shared.config import KvlaneConfig
from shared.kv.step_profile import StepTimeProfile, get_profile

BLOCK = 16
# Every term of the step model that a request owns, non-zero, so that a term the floor drops or miscounts shows.
PROFILE = StepTimeProfile(name="all-terms", a=5e-3, b=3e-5, c=2e-5, d=5e-8, per_request=1e-3, per_output_token=2e-5)


def scheduler(max_num_seqs: int, profile: StepTimeProfile = PROFILE) -> SimScheduler:
    return SimScheduler(num_blocks=20_000, block_size=BLOCK, max_num_seqs=max_num_seqs, max_batched_tokens=100_000,
                        profile=profile, output_token_range=(1000, 2000))


def busy_seconds(engine: SimScheduler) -> float:
    total = 0.0
    while engine.has_work():
        total += engine.step().duration_s
    return total


def test_a_lone_request_costs_its_floor_and_the_one_step_it_may_share_beyond_the_batch() -> None:
    # One sequence at a time, one prefill step: the floor's every term is the scheduler's, and of the fixed
    # cost of its `out` steps the floor counts out - 1 (the sequence finishing in a step leaves its slot
    # to one admitted in the same step).
    for length, out in ((1, 1), (40, 1), (100, 7), (513, 64)):
        engine = scheduler(max_num_seqs=1)
        engine.add(SimRequest("r", list(range(length)), out))
        kind = NodeCost(PROFILE, speed=1.0, max_num_seqs=1, count=1)
        floor = request_seconds(kind, Served("r", 0.0, length, length, out))
        assert busy_seconds(engine) == pytest.approx(floor + PROFILE.a, rel=1e-12)
    # Speed divides the profile's time, and the step overhead is paid with the fixed cost.
    slow = NodeCost(PROFILE, speed=0.5, max_num_seqs=1, count=1, step_overhead_s=1e-3)
    served = Served("r", 0.0, 100, 100, 7)
    assert request_seconds(slow, served) == pytest.approx(2 * request_seconds(NodeCost(PROFILE, 1.0, 1, 1), served) + 6e-3)


prompts = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(prompts, st.integers(1, 8))
def test_a_node_is_busy_at_least_the_floors_of_what_it_serves(requests: list[tuple[int, int, int]], seqs: int) -> None:
    # Prompts that share one of four prefixes, all queued at once on one node: batched, cached, chunked or not.
    rng = random.Random(len(requests))
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((0, 16, 40, 200)))] for _ in range(4)]
    oracle = PrefixOracle(BLOCK)
    engine = scheduler(seqs)
    served = []
    for index, (prefix, own, out) in enumerate(requests):
        prompt = prefixes[prefix] + [rng.randrange(1000) for _ in range(own)]
        oracle.started(str(index), chained_block_hashes(prompt, BLOCK), len(prompt))
        served.append(oracle.ended(str(index), 0.0, prompt, chained_block_hashes(prompt, BLOCK), []))
        engine.add(SimRequest(str(index), prompt, out))
    served = [Served("r", 0.0, s.prompt_tokens, s.uncached_tokens, out) for s, (_, _, out) in zip(served, requests)]
    kind = NodeCost(PROFILE, 1.0, seqs, 1)
    floor = sum(request_seconds(kind, s) for s in served)
    assert busy_seconds(engine) >= floor * (1 - 1e-9)


def test_the_oracle_counts_blocks_computed_before_anywhere_and_answers_as_later_prompts() -> None:
    oracle = PrefixOracle(BLOCK)
    first = list(range(50))  # three full blocks and two tokens
    oracle.started("a", chained_block_hashes(first, BLOCK), len(first))
    # Running at once with the same prompt, its blocks count as computed already: the oracle is generous.
    oracle.started("b", chained_block_hashes(first, BLOCK), len(first))
    answer = list(range(500, 530))
    a = oracle.ended("a", 1.5, first, chained_block_hashes(first, BLOCK), answer)
    b = oracle.ended("b", 2.0, first, chained_block_hashes(first, BLOCK), [])
    assert (a.uncached_tokens, b.uncached_tokens) == (50, 50 - 48)
    assert (a.request_id, a.scheduled_s, a.prompt_tokens, a.output_tokens) == ("a", 1.5, 50, 30)
    # The next turn holds the prompt and the answer: all its full blocks but the new question's were computed.
    turn = first + answer + list(range(900, 940))
    oracle.started("c", chained_block_hashes(turn, BLOCK), len(turn))
    assert oracle.ended("c", 3.0, turn, chained_block_hashes(turn, BLOCK), []).uncached_tokens == len(turn) - 80
    # A prompt seen in full still computes one token, as the engine does.
    oracle.started("d", chained_block_hashes(first[:48], BLOCK), 48)
    assert oracle.ended("d", 4.0, first[:48], chained_block_hashes(first[:48], BLOCK), []).uncached_tokens == 1
    with pytest.raises(ValueError, match="block_size"):
        PrefixOracle(0)


def exact_two_kind_rate(seconds: list[tuple[float, float]], counts: tuple[int, int]) -> float:
    """The linear program's optimum for two kinds: requests in order of their relative cost, split at one."""
    order = sorted(seconds, key=lambda s: s[0] / s[1])
    best = float("inf")
    for k, (first, second) in enumerate(order):
        done_first = sum(s[0] for s in order[:k])
        left_second = sum(s[1] for s in order[k + 1:])
        # Part f of request k on the first kind, so that both kinds finish together (clamped to a whole request).
        f = (counts[0] * (left_second + second) - counts[1] * done_first) / (counts[1] * first + counts[0] * second)
        f = min(1.0, max(0.0, f))
        best = min(best, max((done_first + f * first) / counts[0], (left_second + (1 - f) * second) / counts[1]))
    return len(seconds) / best


requests_strategy = st.lists(st.tuples(st.integers(1, 4000), st.integers(1, 4000), st.integers(1, 400)),
                             min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(requests_strategy, st.integers(1, 5), st.integers(1, 5), st.floats(0.2, 1.0))
def test_the_ceiling_of_two_kinds_is_the_exact_split(requests: list[tuple[int, int, int]], fast: int, slow: int,
                                                     speed: float) -> None:
    kinds = [NodeCost(get_profile("h100-80g-llama3-8b"), 1.0, 64, fast),
             NodeCost(get_profile("a100-80g-llama3-8b"), speed, 64, slow)]
    served = [Served("r", 0.0, length, min(length, uncached), out) for length, uncached, out in requests]
    seconds = [(request_seconds(kinds[0], s), request_seconds(kinds[1], s)) for s in served]
    exact = exact_two_kind_rate(seconds, (fast, slow))
    ceiling = throughput_ceiling(kinds, served)
    # Never below the optimum (the dual bounds it from above), and found to within the search's precision.
    assert ceiling >= exact * (1 - 1e-9)
    assert ceiling <= exact * (1 + 1e-6)


def test_one_kind_is_its_nodes_over_the_mean_floor_and_bad_fleets_are_refused() -> None:
    kind = NodeCost(get_profile("h100-80g-llama3-8b"), 1.0, 64, 4)
    served = [Served("r", 0.0, 2000, 100, 200), Served("r", 0.0, 500, 500, 50)]
    mean = sum(request_seconds(kind, s) for s in served) / 2
    assert throughput_ceiling([kind], served) == pytest.approx(4 / mean)
    # Three kinds: still an upper bound on the two-kind fleet it contains, and close to the pooled one.
    third = NodeCost(get_profile("a100-80g-llama3-8b"), 1.0, 64, 2)
    assert throughput_ceiling([kind, third, NodeCost(get_profile("a100-80g-llama3-8b"), 0.5, 64, 1)], served) > \
        throughput_ceiling([kind, third], served)
    with pytest.raises(ValueError, match="at least one node"):
        throughput_ceiling([NodeCost(get_profile("h100-80g-llama3-8b"), 1.0, 64, 0)], served)
    with pytest.raises(ValueError, match="no requests"):
        throughput_ceiling([kind], [])


def test_an_overloaded_fleet_serves_up_to_the_ceiling_of_what_it_served_and_no_more() -> None:
    # Twice what two nodes serve, for 10 s: the central queue refuses what it cannot hold (before any engine
    # work), and the nodes, always full, finish the rest at a rate just under the ceiling.
    config = with_overrides(KvlaneConfig(), **policy_sections("jffc_per_request"),
                            **{"worker.sim": {"profile": "h100-80g-llama3-8b", "num_blocks": 30_000}})
    work = WorkloadSpec(kind="shared-prefix", seed=5, max_requests=2400, groups=8, system_tokens=1024,
                        question_tokens=64, output_tokens=64, arrival=ArrivalSpec(mode="poisson", rate=240.0))
    spec = SimulationSpec(config, tuple(fleet_nodes(parse_fleet("h100-80g-llama3-8b:1,a100-80g-llama3-8b:1"))), work,
                          DriveLimits(issue_for_s=300.0, hard_stop_s=400.0), 300.0)
    result = Simulation(spec, oracle=PrefixOracle(config.worker.sim.block_size)).run()
    served = [r for r in result.records if r.ok]
    assert {r.error for r in result.records if not r.ok} == {"http_503: queue_full"}
    assert len(result.served) == len(served) > 1000
    achieved = len(served) / (max(r.end_s or 0.0 for r in served) - min(r.sent_s for r in served))
    kinds = [NodeCost(get_profile("h100-80g-llama3-8b"), 1.0, config.worker.sim.max_num_seqs, 1),
             NodeCost(get_profile("a100-80g-llama3-8b"), 1.0, config.worker.sim.max_num_seqs, 1)]
    ceiling = throughput_ceiling(kinds, result.served)
    assert 0.9 * ceiling <= achieved <= ceiling


def test_every_simulated_node_is_busy_at_least_the_floors_of_the_requests_it_ran() -> None:
    # Conversations on a mixed fleet with a straggler, past its capacity: batches, cached histories, chunked prefill.
    config = with_overrides(KvlaneConfig(), **policy_sections("jffc_per_request"),
                            **{"worker.sim": {"profile": "h100-80g-llama3-8b", "num_blocks": 30_000, "max_model_len": 8192}})
    work = WorkloadSpec(kind="multi-turn", seed=2, max_requests=1500, groups=8, system_tokens=1024, turns=3,
                        question_tokens=256, output_tokens=128, think_time_s=1.0, max_model_len=8192,
                        arrival=ArrivalSpec(mode="poisson", rate=20.0))
    fleet = fleet_nodes(parse_fleet("h100-80g-llama3-8b:1,a100-80g-llama3-8b:1,h100-80g-llama3-8b@0.5:1"))
    spec = SimulationSpec(config, tuple(fleet), work, DriveLimits(issue_for_s=300.0, hard_stop_s=900.0), 600.0)
    simulation = Simulation(spec, oracle=PrefixOracle(config.worker.sim.block_size))
    result = simulation.run()
    assert all(r.ok for r in result.records) and len(result.served) == len(result.records)
    assert any(r.turn > 0 for r in result.records) and sum(s.uncached_tokens for s in result.served) < \
        0.5 * sum(s.prompt_tokens for s in result.served)
    floors = dict.fromkeys(simulation.nodes, 0.0)
    for served in result.served:
        node = simulation.nodes[result.runs[served.request_id].worker_id]
        floors[node.worker_id] += request_seconds(
            NodeCost(node.profile, node.speed, config.worker.sim.max_num_seqs, 1), served)
    for worker_id, node in simulation.nodes.items():
        assert 0.3 * node.busy_s < floors[worker_id] <= node.busy_s
