"""Balancer core: outstanding counts, the least-loaded policy and route() (services/balancer)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from contracts.messages import EngineStats, ErrorReply, Heartbeat, RouteDecision, RouteRequest, WorkerRegistration
from services.balancer.outstanding import OutstandingRequests
from services.balancer.policies import Candidate, LeastLoaded, make_policy
from services.balancer.service import BalancerService
from shared.cluster import ClusterView

# --- OutstandingRequests --------------------------------------------------------------


def test_outstanding_basic_counts() -> None:
    out = OutstandingRequests()
    out.add("r1", "a", 10.0)
    out.add("r2", "a", 10.0)
    out.add("r3", "b", 10.0)
    assert (out.count("a"), out.count("b"), out.count("c"), len(out)) == (2, 1, 0, 3)
    out.finish("r1")
    out.finish("r1")  # twice: no effect
    out.finish("unknown")
    assert (out.count("a"), len(out)) == (1, 2)


def test_re_adding_a_request_moves_it() -> None:
    out = OutstandingRequests()
    out.add("r1", "a", 10.0)
    out.add("r1", "b", 20.0)
    assert (out.count("a"), out.count("b"), len(out)) == (0, 1, 1)
    # The old deadline no longer applies.
    assert out.expire(15.0) == 0
    assert out.count("b") == 1
    assert out.expire(20.0) == 1
    assert out.count("b") == 0


def test_expire_drops_only_passed_deadlines() -> None:
    out = OutstandingRequests()
    out.add("early", "a", 5.0)
    out.add("edge", "a", 7.0)
    out.add("late", "a", 9.0)
    assert out.expire(4.9) == 0
    assert out.expire(7.0) == 2  # a deadline equal to now has passed
    assert out.count("a") == 1
    assert out.expire(8.0) == 0
    assert out.expire(100.0) == 1
    assert len(out) == 0


def test_expire_skips_finished_requests() -> None:
    out = OutstandingRequests()
    out.add("r1", "a", 5.0)
    out.finish("r1")
    assert out.expire(10.0) == 0


def test_forget_worker() -> None:
    out = OutstandingRequests()
    out.add("r1", "a", 10.0)
    out.add("r2", "a", 10.0)
    out.add("r3", "b", 10.0)
    out.forget_worker("a")
    out.forget_worker("nobody")
    assert (out.count("a"), out.count("b"), len(out)) == (0, 1, 1)


REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])
WORKERS = st.sampled_from(["a", "b", "c"])
TIMES = st.integers(0, 20).map(float)


class OutstandingMachine(RuleBasedStateMachine):
    """Model: request id -> (worker, deadline) of every un-finished, un-expired add."""

    def __init__(self) -> None:
        super().__init__()
        self.out = OutstandingRequests()
        self.model: dict[str, tuple[str, float]] = {}

    @rule(request_id=REQUEST_IDS, worker=WORKERS, deadline=TIMES)
    def add(self, request_id: str, worker: str, deadline: float) -> None:
        self.out.add(request_id, worker, deadline)
        self.model[request_id] = (worker, deadline)

    @rule(request_id=REQUEST_IDS)
    def finish(self, request_id: str) -> None:
        self.out.finish(request_id)
        self.model.pop(request_id, None)

    @rule(now=TIMES)
    def expire(self, now: float) -> None:
        passed = [r for r, (_, d) in self.model.items() if d <= now]
        assert self.out.expire(now) == len(passed)
        for request_id in passed:
            del self.model[request_id]

    @rule(worker=WORKERS)
    def forget_worker(self, worker: str) -> None:
        self.out.forget_worker(worker)
        self.model = {r: e for r, e in self.model.items() if e[0] != worker}

    @invariant()
    def counts_match(self) -> None:
        expected = Counter(w for w, _ in self.model.values())
        for worker in ("a", "b", "c"):
            assert self.out.count(worker) == expected[worker]
        assert len(self.out) == len(self.model)


OutstandingMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestOutstandingStateful = OutstandingMachine.TestCase


# --- LeastLoaded ----------------------------------------------------------------------


def cand(worker_id: str, running: int = 0, waiting: int = 0, outstanding: int = 0, kv: float = 0.0) -> Candidate:
    return Candidate(worker_id, f"inbox.{worker_id}", running, waiting, outstanding, kv)


REQ = RouteRequest(request_id="r1", model="m", prompt_tokens=10, max_tokens=5, deadline=1e12)


@pytest.mark.parametrize(
    ("running", "waiting", "outstanding", "load"),
    [(0, 0, 0, 0), (2, 3, 1, 5), (1, 0, 4, 4), (2, 2, 4, 4)],
)
def test_candidate_load(running: int, waiting: int, outstanding: int, load: int) -> None:
    assert cand("a", running, waiting, outstanding).load == load


def test_least_loaded_picks_the_minimum() -> None:
    policy = LeastLoaded()
    candidates = [cand("a", running=3), cand("b", running=1, waiting=1), cand("c", outstanding=5)]
    for _ in range(5):
        assert policy.choose(REQ, candidates).worker_id == "b"


def test_outstanding_counts_as_load_when_fresher_than_stats() -> None:
    policy = LeastLoaded()
    candidates = [cand("a", running=1, outstanding=4), cand("b", running=3)]
    assert policy.choose(REQ, candidates).worker_id == "b"


def test_ties_rotate_across_all_tied_candidates() -> None:
    policy = LeastLoaded()
    candidates = [cand("a", running=1), cand("b", running=1), cand("c", running=1), cand("d", running=9)]
    picks = [policy.choose(REQ, candidates).worker_id for _ in range(9)]
    assert set(picks) == {"a", "b", "c"}
    assert Counter(picks) == {"a": 3, "b": 3, "c": 3}
    # Consecutive picks never repeat while the tie lasts.
    assert all(x != y for x, y in zip(picks, picks[1:]))


def test_kv_usage_breaks_ties() -> None:
    policy = LeastLoaded()
    candidates = [cand("a", running=1, kv=0.5), cand("b", running=1, kv=0.2), cand("c", running=0, kv=0.9)]
    assert policy.choose(REQ, candidates).worker_id == "c"  # load first
    candidates = [cand("a", running=1, kv=0.5), cand("b", running=1, kv=0.2)]
    assert {policy.choose(REQ, candidates).worker_id for _ in range(4)} == {"b"}


def test_single_candidate() -> None:
    only = cand("a", running=50)
    assert LeastLoaded().choose(REQ, [only]) == only


def test_make_policy() -> None:
    policy = make_policy("least_loaded")
    assert isinstance(policy, LeastLoaded)
    assert policy.name == "least_loaded"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("round_robin")


# --- BalancerService.route ------------------------------------------------------------

TTL = 3.0
NOW_MONO = 1000.0
NOW_WALL = 1_700_000_000.0


def heartbeat(worker_id: str, *, model: str = "m", draining: bool = False, running: int = 0, used: int = 0) -> Heartbeat:
    registration = WorkerRegistration(
        worker_id=worker_id,
        role="aggregated",
        model=model,
        engine="sim",
        inbox=f"inbox.{worker_id}",
        block_size=16,
        max_model_len=4096,
        tokenizer="sim",
        started_at=0.0,
    )
    stats = EngineStats(running=running, kv_blocks_total=100, kv_blocks_used=used)
    return Heartbeat(registration=registration, stats=stats, sent_at=NOW_WALL, seq=1, draining=draining)


class Clock:
    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self) -> float:
        return self.value


def make_balancer(*heartbeats: Heartbeat) -> tuple[BalancerService, Clock, Clock]:
    view = ClusterView(TTL)
    for h in heartbeats:
        view.observe(h, NOW_MONO)
    mono, wall = Clock(NOW_MONO), Clock(NOW_WALL)
    return BalancerService(None, view, LeastLoaded(), clock=mono, wall_clock=wall), mono, wall  # type: ignore[arg-type]


def route_request(request_id: str = "r1", model: str = "m", deadline: float = NOW_WALL + 60, exclude: list[str] | None = None) -> RouteRequest:
    return RouteRequest(
        request_id=request_id, model=model, prompt_tokens=10, max_tokens=5, deadline=deadline, exclude_workers=exclude or []
    )


def test_route_to_the_only_node() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"))
    reply = balancer.route(route_request())
    assert isinstance(reply, RouteDecision)
    assert (reply.request_id, reply.worker_id, reply.inbox, reply.policy) == ("r1", "a", "inbox.a", "least_loaded")


def test_model_not_found() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", model="other"))
    reply = balancer.route(route_request(model="m"))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code) == (404, "model_not_found")
    assert "'m'" in reply.message


def test_empty_cluster_is_model_not_found() -> None:
    balancer, _, _ = make_balancer()
    reply = balancer.route(route_request())
    assert isinstance(reply, ErrorReply) and reply.status == 404


def test_stale_nodes_are_not_routed_to() -> None:
    balancer, mono, _ = make_balancer(heartbeat("a"))
    mono.value = NOW_MONO + TTL + 1
    reply = balancer.route(route_request())
    assert isinstance(reply, ErrorReply) and reply.code == "model_not_found"


def test_all_draining_is_503() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", draining=True), heartbeat("b", draining=True))
    reply = balancer.route(route_request())
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code) == (503, "no_capacity")
    assert reply.retry_after_s == 1.0


def test_draining_node_is_skipped() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", draining=True), heartbeat("b", running=10))
    for i in range(3):
        reply = balancer.route(route_request(f"r{i}"))
        assert isinstance(reply, RouteDecision) and reply.worker_id == "b"


def test_excluded_workers_are_honoured() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b", running=50))
    for i in range(3):
        reply = balancer.route(route_request(f"r{i}", exclude=["a"]))
        assert isinstance(reply, RouteDecision) and reply.worker_id == "b"


def test_every_worker_excluded_is_503() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"))
    reply = balancer.route(route_request(exclude=["a", "b"]))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code, reply.retry_after_s) == (503, "no_capacity", 1.0)


@pytest.mark.parametrize("offset", [0.0, -1.0])
def test_deadline_passed_is_504(offset: float) -> None:
    balancer, _, _ = make_balancer(heartbeat("a"))
    reply = balancer.route(route_request(deadline=NOW_WALL + offset))
    assert isinstance(reply, ErrorReply)
    assert (reply.status, reply.code) == (504, "deadline_exceeded")


def test_successive_routes_spread_over_idle_nodes() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"))
    picks = []
    for i in range(6):
        reply = balancer.route(route_request(f"r{i}"))
        assert isinstance(reply, RouteDecision)
        picks.append(reply.worker_id)
    assert Counter(picks) == {"a": 3, "b": 3}
    assert all(x != y for x, y in zip(picks, picks[1:]))


def test_least_loaded_node_wins_until_outstanding_evens_out() -> None:
    balancer, _, _ = make_balancer(heartbeat("a", running=2), heartbeat("b"))
    picks = [balancer.route(route_request(f"r{i}")).worker_id for i in range(4)]  # type: ignore[union-attr]
    # b has load 0, 1 then 2 (outstanding > running+waiting); a stays at 2.
    assert picks[:2] == ["b", "b"]
    assert sorted(picks[2:]) == ["a", "b"]


def test_finished_requests_stop_counting() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), heartbeat("b"))
    first = balancer.route(route_request("r1"))
    assert isinstance(first, RouteDecision)
    balancer._outstanding.finish("r1")
    # With r1 finished both nodes are idle again; a burst still alternates.
    second = balancer.route(route_request("r2"))
    third = balancer.route(route_request("r3"))
    assert {second.worker_id, third.worker_id} == {"a", "b"}  # type: ignore[union-attr]


def test_expired_requests_stop_counting() -> None:
    balancer, _, wall = make_balancer(heartbeat("a"), heartbeat("b", running=1))
    for i in range(3):
        balancer.route(route_request(f"short{i}", deadline=NOW_WALL + 5))
    assert balancer._outstanding.count("a") + balancer._outstanding.count("b") == 3
    wall.value = NOW_WALL + 5
    reply = balancer.route(route_request("late", deadline=NOW_WALL + 60))
    assert isinstance(reply, RouteDecision)
    assert reply.worker_id == "a"  # all earlier entries expired: a (load 0) beats b (running 1)
    assert len(balancer._outstanding) == 1
