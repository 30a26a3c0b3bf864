"""The chain index decides exactly as a fresh snapshot per decision does.

Two routers receive the same random event sequence (heartbeats with
changing stats and measured speeds, route requests with cached prefixes
and exclusions, finishes, undos, other replicas' counts, health verdicts,
nodes joining, restarting and leaving, prefill and decode nodes, time
passing): one decides on the chain index, the other builds a snapshot for
every decision, as the balancer did before the index existed. Every
outcome must be equal, chain state included; and every free chain's
indexed `jffc_per_request` cost must equal its scalar `expected_seconds`.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from services.balancer.central_queue import CentralQueue
from services.balancer.policies import POLICY_NAMES, make_policy
from services.balancer.policies.jffc import JffcPerRequest
from services.balancer.router import Placement, Router
from services.balancer.slot_table import SlotTable
from services.balancer.snapshot import ClusterSnapshot, SnapshotBuilder, chain_id_of
from services.balancer.speed import StepModel
from services.balancer.trackers import QueueGrowth, SpeedTracker
from shared.config import BalancerSettings, JffcPerRequestSettings, PrefixAffinitySettings, QueueSettings, ScoreSettings, SlotSettings
from shared.kv.prefix_index import PrefixIndex
from tests.unit.balancer_fixtures import NOW_WALL, TINY, heartbeat, request

WORKERS = [f"w{i}" for i in range(6)]
PREFIX = list(range(1000, 1008))  # the block hashes of `request(blocks=n)`
WITH_D = StepModel(a=2e-3, b=2e-5, c=2e-4, d=1e-7, per_request=1e-3)
MODELS = (TINY, WITH_D)  # without and with the KV and per-request terms (the index skips them when no node has them)


def build(policy: str, imposed_weight: float, use_index: bool, clock, model: StepModel = WITH_D) -> Router:
    s = BalancerSettings(
        policy=policy, slots=SlotSettings(store="local"),  # type: ignore[arg-type]
        jffc_per_request=JffcPerRequestSettings(imposed_delay_weight=imposed_weight),
        # Loads this small fleet reaches (a few requests per node, over a health weight) count as imbalanced.
        prefix_affinity=PrefixAffinitySettings(balance_abs_threshold=2.0),
        # Cache counts for little in the score: the best-scored chain is often not the cache node, which it may fast-forward to.
        score=ScoreSettings(cache_weight=0.05),
        queue=QueueSettings(max_length=4),
    )
    builder = SnapshotBuilder(s, SpeedTracker(model, s.speed.smoothing, s.speed.equal_within), QueueGrowth(s.speed.smoothing),
                              clock=clock)
    return Router(make_policy(policy, s), builder, PrefixIndex(), SlotTable(), CentralQueue(s.queue.max_length), s.queue,
                  s.disaggregation, s.degradation, use_index=use_index)


class IndexMatchesSnapshot(RuleBasedStateMachine):
    policy = "jffc_per_request"

    @initialize(imposed_weight=st.sampled_from([0.0, 1.0, 0.5]), nodes=st.integers(1, len(WORKERS)), model=st.sampled_from(MODELS))
    def setup(self, imposed_weight: float, nodes: int, model: StepModel) -> None:
        policy = self.policy
        self.now = NOW_WALL
        clock = lambda: self.now  # noqa: E731
        self.indexed = build(policy, imposed_weight, True, clock, model)
        self.reference = build(policy, imposed_weight, False, clock, model)
        assert self.indexed.chains is not None and self.reference.chains is None
        self.nodes: dict[str, msgspec.Struct] = {}
        self.started: dict[str, float] = {}
        self.running: dict[str, str] = {}  # request id -> worker id
        self.placements: list[Placement] = []
        self.requests = 0
        for worker_id in WORKERS[:nodes]:
            self._beat(worker_id, running=0, waiting=0, used=0, blocks=128, decode_tps=0.0, role="aggregated")

    @property
    def heartbeats(self) -> list:
        return list(self.nodes.values())

    def both(self, call) -> tuple:
        return call(self.indexed), call(self.reference)

    def _beat(self, worker_id: str, *, running: int, waiting: int, used: int, blocks: int, decode_tps: float, role: str,
              gpu: float | None = None) -> None:
        self.now += 0.01
        hb = heartbeat(worker_id, running=running, waiting=waiting, used=used, blocks=blocks, sent_at=self.now,
                       decode_tps=decode_tps, prefill_tps=100.0, started_at=self.started.setdefault(worker_id, 1.0), role=role)
        hb = msgspec.structs.replace(hb, stats=msgspec.structs.replace(hb.stats, gpu_utilization=gpu))
        self.nodes[worker_id] = hb
        self.both(lambda r: r.observe(hb))

    @rule(worker=st.sampled_from(WORKERS), running=st.integers(0, 4), waiting=st.integers(0, 3), used=st.integers(0, 200),
          blocks=st.sampled_from([0, 64, 128, 256]), decode_tps=st.sampled_from([0.0, 50.0, 200.0, 800.0]),
          role=st.sampled_from(["aggregated"] * 6 + ["prefill", "decode"]), gpu=st.sampled_from([None, None, 0.3, 0.65, 0.9]))
    def heartbeat_or_join(self, worker: str, running: int, waiting: int, used: int, blocks: int, decode_tps: float,
                          role: str, gpu: float | None) -> None:
        if worker in self.nodes:
            role = self.nodes[worker].registration.role  # type: ignore[attr-defined]
        self._beat(worker, running=running, waiting=waiting, used=used, blocks=blocks, decode_tps=decode_tps, role=role, gpu=gpu)

    @precondition(lambda self: self.nodes)
    @rule(index=st.integers(0, 100), restart=st.booleans())
    def leave_or_restart(self, index: int, restart: bool) -> None:
        worker = sorted(self.nodes)[index % len(self.nodes)]
        if restart:
            self.started[worker] += 1.0
            self._beat(worker, running=0, waiting=0, used=0, blocks=128, decode_tps=0.0,
                       role=self.nodes[worker].registration.role)  # type: ignore[attr-defined]
        else:
            del self.nodes[worker]
        got, expected = self.both(lambda r: r.prune(self.now, self.heartbeats))
        assert got == expected

    @precondition(lambda self: self.nodes)
    @rule(index=st.integers(0, 100), reorder=st.booleans())
    def reorder(self, index: int, reorder: bool) -> None:
        """The cluster view may list the same nodes in another order."""
        order = sorted(self.nodes, reverse=reorder)
        order = order[index % len(order):] + order[: index % len(order)]
        self.nodes = {w: self.nodes[w] for w in order}

    @rule(prompt=st.integers(0, 200), output=st.integers(1, 64), blocks=st.integers(0, len(PREFIX)),
          exclude=st.sets(st.sampled_from(WORKERS), max_size=2), priority=st.integers(0, 1))
    def route(self, prompt: int, output: int, blocks: int, exclude: set[str], priority: int) -> None:
        self.route_one(prompt, output, blocks, exclude, priority)

    @rule(shapes=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 64), st.integers(0, len(PREFIX))), min_size=2, max_size=5))
    def burst(self, shapes: list[tuple[int, int, int]]) -> None:
        """Requests back to back: each placement changes what the next one sees."""
        for prompt, output, blocks in shapes:
            self.route_one(prompt, output, blocks, set(), 0)

    def route_one(self, prompt: int, output: int, blocks: int, exclude: set[str], priority: int) -> None:
        self.requests += 1
        req = request(f"r{self.requests}", prompt=prompt, output=output, blocks=blocks, exclude=sorted(exclude), priority=priority)
        heartbeats = self.heartbeats
        if isinstance(self.indexed.policy, JffcPerRequest):
            self._check_costs(req, heartbeats)
        got, expected = self.both(lambda r: r.admit(req, heartbeats, self.now))
        assert got == expected
        if isinstance(got, Placement):
            self.running[req.request_id] = got.chain.worker_id
            self.placements.append(got)

    def _check_costs(self, req, heartbeats) -> None:
        index = self.indexed.chains
        assert index is not None
        if not index.sync(heartbeats):
            return
        cached = self.indexed.index.match(req.block_hashes)
        decision = index.decision(req, cached)
        policy = self.indexed.policy
        costs = policy.expected_seconds_indexed(req, decision)  # type: ignore[attr-defined]
        # As `Router.place` bounds the backlog on a snapshot: against the fastest prefill among the chains it may take.
        takeable = ClusterSnapshot(tuple(decision.state(row) for row in decision.eligible.nonzero()[0].tolist()), 0)
        elsewhere = req.prompt_tokens * takeable.fastest_prefill_per_token_s()
        waits = {}
        for row in decision.free_rows.tolist():
            state = decision.state(row)
            assert costs[row] == policy.expected_seconds(req, state)  # type: ignore[attr-defined]
            waits[row] = state.first_token_wait_s(req.prompt_tokens)
        # The backlog bound leaves out exactly the chains the snapshot path's bound does, at the edges too.
        beyond = sorted(wait - elsewhere for wait in waits.values())
        for bound in {0.0, *beyond[:: max(1, len(beyond) // 3)], max(beyond, default=0.0)}:
            limited = index.decision(req, cached)
            limited.limit_backlog(bound, req.prompt_tokens)
            assert limited.free_rows.tolist() == [row for row, wait in waits.items() if wait <= bound + elsewhere]

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), dispatch=st.booleans())
    def finish(self, index: int, dispatch: bool) -> None:
        request_id = sorted(self.running)[index % len(self.running)]
        worker = self.running.pop(request_id)
        assert self.indexed.finished(request_id, worker) == self.reference.finished(request_id, worker)
        if dispatch:
            got, expected = self.both(lambda r: r.dispatch_queued(lambda model: self.heartbeats))
            assert got == expected
            for _, placement in got:
                self.running[placement.request_id] = placement.chain.worker_id

    @precondition(lambda self: self.placements)
    @rule(index=st.integers(0, 100), used=st.integers(0, 4))
    def undo(self, index: int, used: int) -> None:
        """Another replica took the slot first."""
        placement = self.placements.pop(index % len(self.placements))
        if placement.request_id in self.running:
            del self.running[placement.request_id]
            self.both(lambda r: r.undo(placement, used))

    @precondition(lambda self: self.nodes)
    @rule(index=st.integers(0, 100), used=st.integers(0, 4))
    def foreign_count(self, index: int, used: int) -> None:
        hb = self.heartbeats[index % len(self.nodes)]
        self.both(lambda r: r.table.set_global_used(chain_id_of(hb), used))  # type: ignore[arg-type]

    @rule(worker=st.sampled_from(WORKERS), weight=st.sampled_from([0.0, 0.25, 0.5, 1.0]))
    def health(self, worker: str, weight: float) -> None:
        self.both(lambda r: r.builder.set_health_weight(worker, weight))

    @rule(worker=st.sampled_from(WORKERS), depth=st.integers(0, len(PREFIX)), cleared=st.booleans())
    def kv_events(self, worker: str, depth: int, cleared: bool) -> None:
        self.both(lambda r: r.index.apply(worker, stored=PREFIX[:depth], cleared=cleared))

    @rule(seconds=st.sampled_from([0.0, 0.001, 0.05, 1.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def same_reservations(self) -> None:
        if hasattr(self, "indexed"):
            assert sorted(self.indexed.table.held()) == sorted(self.reference.table.held())

    @invariant()
    def facts_read_at_the_same_moments(self) -> None:
        """Facts take the trackers' values when first read: the index reads each node's when the snapshot path would."""
        if hasattr(self, "indexed"):
            for worker in WORKERS:
                assert self.indexed.builder.cached_facts(worker) == self.reference.builder.cached_facts(worker)


def machine_for(policy: str, examples: int):
    machine = type(f"IndexMatchesSnapshot_{policy}", (IndexMatchesSnapshot,), {"policy": policy})
    machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=50, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
    return machine.TestCase


# The default policy gets most of the examples; the others share the column code it exercises.
TestJffcPerRequestIndex = machine_for("jffc_per_request", 150)
TestJffcIndex = machine_for("jffc", 40)
TestLeastLoadedIndex = machine_for("least_loaded", 40)
TestRoundRobinIndex = machine_for("round_robin", 40)
TestRandomIndex = machine_for("random", 25)
TestPowerOfTwoIndex = machine_for("power_of_two", 25)
TestPrefixAffinityIndex = machine_for("prefix_affinity", 100)
TestKvCostIndex = machine_for("kv_cost", 40)
TestScoreIndex = machine_for("score", 150)
TestLoraAffinityIndex = machine_for("lora_affinity", 25)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_takes_the_index(policy: str) -> None:
    """Each of these policies routes an all-aggregated fleet without a snapshot."""
    router = build(policy, 1.0, True, lambda: NOW_WALL)
    router.builder.snapshot = None  # type: ignore[assignment,method-assign]
    heartbeats = [heartbeat(w, sent_at=NOW_WALL) for w in WORKERS]
    placement = router.admit(request("r1"), heartbeats, NOW_WALL)
    assert isinstance(placement, Placement)



def _indexed_decision(router: Router, req):
    heartbeats = [heartbeat(w, sent_at=NOW_WALL) for w in WORKERS]
    for hb in heartbeats:
        router.observe(hb)
    index = router.chains
    assert index is not None and index.sync(heartbeats)
    return index, index.decision(req, router.index.match(req.block_hashes))


def test_least_names_float_columns_only() -> None:
    _, decision = _indexed_decision(build("least_loaded", 1.0, True, lambda: NOW_WALL), request("r1"))
    assert decision.least("load", "-speed") == decision.free_rows.tolist() == list(range(len(WORKERS)))  # identical nodes: all tied
    with pytest.raises(ValueError, match="slots_used"):
        decision.least("load", "slots_used")
    with pytest.raises(ValueError):
        decision.least()


def test_a_decision_reads_the_request_columns_only_until_the_next_one() -> None:
    """Each decision writes its request's cached blocks into the index: an older one must not cost with them."""
    router = build("jffc_per_request", 1.0, True, lambda: NOW_WALL)
    index, first = _indexed_decision(router, request("r1"))
    assert len(first.request_seconds(64, 16, 1.0)) == len(WORKERS)
    index.decision(request("r2"), {})
    with pytest.raises(RuntimeError):
        first.cheapest(64, 16, 1.0)


def test_score_fast_forwards_to_the_first_of_equally_cached_nodes_as_on_a_snapshot() -> None:
    """The prefix index lists the caching nodes in the order they stored the prefix, not in the fleet's."""
    outcomes = []
    for use_index in (True, False):
        router = build("score", 1.0, use_index, lambda: NOW_WALL)
        router.policy._settings = ScoreSettings(cache_weight=0.0)  # type: ignore[attr-defined]
        heartbeats = [heartbeat(w, sent_at=NOW_WALL, waiting=3 if w in ("w1", "w3") else 0, blocks=1024) for w in WORKERS]
        for worker in ("w3", "w1"):
            router.index.apply(worker, stored=PREFIX)
        placement = router.admit(request("r1", blocks=len(PREFIX), prompt=256), heartbeats, NOW_WALL)
        assert isinstance(placement, Placement) and placement.fast_forward
        outcomes.append(placement)
    assert outcomes[0] == outcomes[1] and outcomes[0].chain.worker_id == "w1"


def _poison_load(router: Router, row: int) -> None:
    """Every decision on the index sees a NaN load on `row`; a snapshot still reads the node's real one."""
    assert router.chains is not None
    decide = router.chains.decision

    def poisoned(*args, **kwargs):
        decision = decide(*args, **kwargs)
        decision.index.load[row] = float("nan")
        return decision
    router.chains.decision = poisoned  # type: ignore[method-assign]


@pytest.mark.parametrize("policy", ["jffc", "least_loaded", "prefix_affinity"])
def test_a_nan_figure_leaves_the_decision_to_a_snapshot_with_no_tie_turn_taken(policy: str) -> None:
    router = build(policy, 1.0, True, lambda: NOW_WALL)
    reference = build(policy, 1.0, False, lambda: NOW_WALL)
    _poison_load(router, 1)
    snapshots = []
    snapshot = router.builder.snapshot
    router.builder.snapshot = lambda *args: snapshots.append(1) or snapshot(*args)  # type: ignore[method-assign]
    heartbeats = [heartbeat(w, sent_at=NOW_WALL) for w in WORKERS]
    for i in range(3):  # identical nodes: every decision a tie, taken in turn
        got, expected = (r.admit(request(f"r{i}"), heartbeats, NOW_WALL) for r in (router, reference))
        assert got == expected
    assert len(snapshots) == 3
