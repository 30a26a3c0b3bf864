"""The balancer core driven by events: what it decides, as effects (services/balancer/core.py)."""

from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from contracts.health import HealthVerdict
from contracts.messages import Heartbeat
from services.balancer.core import (
    DRAIN,
    Abort,
    BalancerCore,
    Drain,
    Effect,
    NodesGone,
    Placed,
    Preempted,
    ReadUsage,
    Refused,
    Release,
    ReleaseEarlier,
    Requeued,
    Reserve,
    Waiting,
)
from shared.config import DegradationSettings, QueueSettings
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router


class Clock:
    def __init__(self) -> None:
        self.now = NOW_WALL

    def __call__(self) -> float:
        return self.now


def make_core(*workers: str, slots: int = 1, queue_length: int = 64, degradation: DegradationSettings | None = None,
              queue: QueueSettings | None = None) -> tuple[BalancerCore, list[Heartbeat], Clock]:
    clock = Clock()
    heartbeats = [heartbeat(worker_id) for worker_id in workers]
    r = router(max_per_chain=slots, queue_length=queue_length, degradation=degradation, queue=queue, clock=clock)
    core = BalancerCore(r, lambda model: [hb for hb in heartbeats if hb.registration.model == model], lambda: heartbeats)
    for hb in heartbeats:
        core.heartbeat(hb)
    return core, heartbeats, clock


def chain_of(core: BalancerCore, worker_id: str) -> str:
    return core.router.builder.facts(heartbeat(worker_id)).chain_id


def only(effects: list[Effect], kind: type) -> Effect:
    assert len(effects) == 1 and isinstance(effects[0], kind), effects
    return effects[0]


def placed(core: BalancerCore, request_id: str) -> Reserve:
    """Route `request_id` and return the reservation the store is to make."""
    return only(core.route(request(request_id, blocks=0), NOW_WALL), Reserve)  # type: ignore[return-value]


# --- routing ------------------------------------------------------------------------------------


def test_a_confirmed_reservation_is_the_reply() -> None:
    core, _, _ = make_core("a")
    reserve = placed(core, "r1")
    assert reserve.entry is None and reserve.placement.chain.worker_id == "a"
    assert core.router.table.holder("r1") == chain_of(core, "a")  # held while the store answers
    reply = only(core.confirmed(reserve, taken=True, used=1), Placed)
    assert reply == Placed(reserve.placement, None)


def test_a_request_past_its_deadline_or_for_no_model_is_refused_without_a_decision() -> None:
    core, _, _ = make_core("a")
    late = only(core.route(request("late", timeout_s=0.0), NOW_WALL), Refused)
    assert (late.request_id, late.reply.status) == ("late", 504)  # type: ignore[union-attr]
    unknown = only(core.route(request("x", model="other"), NOW_WALL), Refused)
    assert unknown.reply.code == "model_not_found"  # type: ignore[union-attr]
    assert core.decisions == 0


def test_a_slot_another_balancer_took_is_undone_and_the_request_placed_once_per_chain_at_most() -> None:
    core, _, _ = make_core("a", "b", slots=2)
    first = placed(core, "r1")
    again = only(core.confirmed(first, taken=False, used=2), Reserve)
    assert again.placement.chain.worker_id != first.placement.chain.worker_id
    assert core.router.table.holder("r1") == again.placement.chain.chain_id
    # Both chains now known full: the third try finds none free and queues the request.
    assert isinstance(only(core.confirmed(again, taken=False, used=2), Waiting), Waiting)
    assert core.router.table.holder("r1") is None and core.decisions == 3


def test_tries_end_with_a_refusal_when_every_try_was_refused() -> None:
    core, _, _ = make_core("a", "b")
    reserve = placed(core, "r1")
    for _ in range(2):
        # Each refusal says the chain still has room: the core places it again, but not for ever.
        reserve = only(core.confirmed(reserve, taken=False, used=0), Reserve)  # type: ignore[assignment]
    refused = only(core.confirmed(reserve, taken=False, used=0), Refused)
    assert (refused.request_id, refused.reply.code, refused.reply.status) == ("r1", "no_capacity", 503)  # type: ignore[union-attr]
    assert core.decisions == 3  # one per chain, and one more


def test_no_kv_room_takes_the_chain_as_full_until_the_tick_reads_it_again() -> None:
    core, _, clock = make_core("a", "b", slots=4)
    first = placed(core, "r1")
    full = first.placement.chain.chain_id
    again = only(core.confirmed(first, taken=True, used=1, leased=False), Reserve)
    assert again.placement.chain.chain_id != full
    assert core.router.table.used(full) == 4 and core.kv_refusals == 1
    only(core.confirmed(again, taken=True, used=1), Placed)
    clock.now += 1
    effects = core.tick(clock.now)
    # The chain counted by the reservation's reply is not read again; the full one is.
    assert only(effects, ReadUsage) == ReadUsage([full])
    assert core.counted({full: 0}) == []
    assert core.router.table.used(full) == 0


def test_preempted_requests_lose_their_slot_and_are_told() -> None:
    core, _, _ = make_core("a", slots=2)
    victim = placed(core, "victim")
    only(core.confirmed(victim, taken=True), Placed)
    reserve = placed(core, "r2")
    assert core.confirmed(reserve, taken=True, preempted=["victim"]) == [Preempted("victim"), Placed(reserve.placement, None)]
    assert core.router.table.holder("victim") is None


def test_routing_again_frees_the_earlier_slot_first() -> None:
    core, _, _ = make_core("a", "b")
    first = placed(core, "r1")
    only(core.confirmed(first, taken=True), Placed)
    earlier = first.placement.chain
    effects = core.route(request("r1", blocks=0, exclude=[earlier.worker_id]), NOW_WALL)
    assert effects[0] == ReleaseEarlier([("r1", earlier.worker_id)], [earlier.chain_id])
    assert isinstance(effects[1], Reserve) and effects[1].placement.chain.worker_id != earlier.worker_id
    # Excluded, but placed by another balancer: the store finds the slot through the excluded node.
    core.router.table.release("r1")
    effects = core.route(request("r1", blocks=0, exclude=["a"]), NOW_WALL)
    assert effects[0] == ReleaseEarlier([("r1", "a")], None)


# --- the queue ---------------------------------------------------------------------------------


def test_a_queued_request_gets_the_slot_its_predecessor_frees_once_the_store_freed_it() -> None:
    core, _, clock = make_core("a")
    only(core.confirmed(placed(core, "r1"), taken=True), Placed)
    waiting = only(core.route(request("r2", blocks=0), NOW_WALL), Waiting)
    chain_id = chain_of(core, "a")
    assert core.finished("r1", "a") == [Release("r1", "a", chain_id)]
    assert core.released([(chain_id, 0)]) == [DRAIN]
    reserve = only(core.dispatch(), Reserve)
    assert reserve.entry == waiting.entry  # type: ignore[union-attr]
    clock.now += 2
    assert core.confirmed(reserve, taken=True, used=1) == [Placed(reserve.placement, waiting.entry)]  # type: ignore[union-attr]
    assert core.released([]) == []  # nothing waits: no drain


def test_a_queued_request_whose_slot_is_taken_elsewhere_waits_again_at_its_place() -> None:
    core, _, _ = make_core("a")
    only(core.confirmed(placed(core, "r1"), taken=True), Placed)
    only(core.route(request("r2", blocks=0), NOW_WALL), Waiting)
    only(core.route(request("r3", blocks=0), NOW_WALL), Waiting)
    core.finished("r1", "a")
    reserve = only(core.dispatch(), Reserve)
    assert reserve.entry is not None and reserve.entry.request_id == "r2"
    assert core.confirmed(reserve, taken=False, used=1) == [Requeued(reserve.entry)]
    assert [e.request_id for e in core.router.queue.in_order()] == ["r2", "r3"]
    assert core.dispatch() == []  # the chain is known full now


def test_a_higher_class_takes_a_full_queue_s_last_place() -> None:
    core, _, _ = make_core("a", queue_length=1, degradation=DegradationSettings(evict_lower_when_full=True))
    only(core.confirmed(placed(core, "r1"), taken=True), Placed)
    only(core.route(request("low", blocks=0), NOW_WALL), Waiting)
    evicted, waiting = core.route(request("high", blocks=0, priority=2), NOW_WALL)
    assert isinstance(evicted, Refused) and (evicted.request_id, evicted.reply.status) == ("low", 429)
    assert isinstance(waiting, Waiting) and waiting.entry.request_id == "high"


def test_a_withdrawn_request_is_answered_if_queued_and_aborted_where_it_runs() -> None:
    core, _, _ = make_core("a")
    only(core.confirmed(placed(core, "r1"), taken=True), Placed)
    only(core.route(request("r2", blocks=0), NOW_WALL), Waiting)
    refused, release = core.withdrawn("r2")
    assert refused == Refused("r2", refused.reply) and refused.reply.status == 499  # type: ignore[union-attr]
    assert release == Release("r2", None, None)  # held nowhere here
    chain_id = chain_of(core, "a")
    assert core.withdrawn("r1") == [Release("r1", "a", chain_id), Abort("r1", "a")]
    assert core.withdrawn("r1") == [Release("r1", None, None)]  # twice: nothing more


def test_the_tick_expires_reservations_and_queued_requests_and_forgets_nodes_that_left() -> None:
    core, heartbeats, clock = make_core("a", "b")
    for request_id in ("r1", "r2"):
        only(core.confirmed(placed(core, request_id), taken=True), Placed)
    only(core.route(request("r3", blocks=0, timeout_s=5.0), NOW_WALL), Waiting)
    del heartbeats[1]  # b stops heartbeating
    clock.now += 10
    gone, expired, read = core.tick(clock.now)
    assert gone == NodesGone(["b"])
    assert isinstance(expired, Refused) and (expired.request_id, expired.reply.code) == ("r3", "queue_timeout")
    assert read == ReadUsage([chain_of(core, "a")])  # nothing counted since the last tick
    assert core.router.table.total_used() == 1 and core.expired == 1
    clock.now += 100  # past r1's deadline
    core.tick(clock.now)
    assert core.router.table.total_used() == 0 and core.expired == 2


def test_a_queued_request_past_its_deadline_between_ticks_is_refused() -> None:
    core, _, _ = make_core("a")
    only(core.confirmed(placed(core, "r1"), taken=True), Placed)
    waiting = only(core.route(request("r2", blocks=0), NOW_WALL), Waiting)
    refused = core.queue_deadline(waiting.entry)  # type: ignore[union-attr]
    assert (refused.request_id, refused.reply.code) == ("r2", "queue_timeout")
    assert len(core.router.queue) == 0


def test_heartbeats_and_health_offer_free_slots_to_the_queue() -> None:
    core, heartbeats, _ = make_core("a")
    assert core.heartbeat(heartbeats[0]) == []  # nothing waits
    only(core.confirmed(placed(core, "r1"), taken=True), Placed)
    only(core.route(request("r2", blocks=0), NOW_WALL), Waiting)
    assert core.heartbeat(heartbeats[0]) == [DRAIN]
    assert core.health(HealthVerdict(worker_id="a", state="healthy", weight=1.0, reason="", since=NOW_WALL)) == [DRAIN]


# --- any order of events -------------------------------------------------------------------------

WORKERS = ("a", "b")
SLOTS = 2


class CoreMachine(RuleBasedStateMachine):
    """Route requests, store answers, ends, withdrawals and ticks in any order, carried out as a shell would."""

    def __init__(self) -> None:
        super().__init__()
        self.core, self.heartbeats, self.clock = make_core(*WORKERS, slots=SLOTS, queue_length=3)
        self.pending: list[Reserve] = []  # reservations the store has not answered yet
        self.replies: Counter[str] = Counter()
        self.placed: set[str] = set()
        self.routed: list[str] = []
        self.drain_due = False

    def run(self, effects: list[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, (Placed, Refused)):
                request_id = effect.placement.request_id if isinstance(effect, Placed) else effect.request_id
                self.replies[request_id] += 1
                if isinstance(effect, Placed):
                    self.placed.add(request_id)
            elif isinstance(effect, Reserve):
                self.pending.append(effect)
            elif isinstance(effect, Release):
                self.run(self.core.released(()))
            elif isinstance(effect, (Drain, Requeued)):
                self.drain_due = True
            elif isinstance(effect, ReadUsage):
                own = self.core.router.table.own
                self.run(self.core.counted({chain_id: own(chain_id) for chain_id in effect.chains}))

    @rule(priority=st.integers(0, 2), timeout_s=st.sampled_from([0.0, 1.0, 30.0]))
    def route(self, priority: int, timeout_s: float) -> None:
        request_id = f"r{len(self.routed)}"
        self.routed.append(request_id)
        self.run(self.core.route(request(request_id, blocks=0, priority=priority, timeout_s=timeout_s), self.clock.now))

    @rule(data=st.data(), taken=st.booleans(), leased=st.booleans(), used=st.integers(-1, SLOTS))
    def store_answers(self, data: st.DataObject, taken: bool, leased: bool, used: int) -> None:
        if self.pending:
            reserve = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
            self.run(self.core.confirmed(reserve, taken, used, leased))

    @rule(data=st.data(), worker_id=st.sampled_from(WORKERS))
    def finished(self, data: st.DataObject, worker_id: str) -> None:
        if self.routed:
            self.run(self.core.finished(data.draw(st.sampled_from(self.routed)), worker_id))

    @rule(data=st.data())
    def withdrawn(self, data: st.DataObject) -> None:
        if self.routed:
            self.run(self.core.withdrawn(data.draw(st.sampled_from(self.routed))))

    @rule()
    def drain(self) -> None:
        if self.drain_due:
            self.drain_due = False
            self.run(self.core.dispatch())  # type: ignore[arg-type]

    @rule(seconds=st.sampled_from([0.5, 5.0, 60.0]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        self.run(self.core.tick(self.clock.now))

    @invariant()
    def no_chain_holds_more_than_its_slots(self) -> None:
        table = self.core.router.table
        for worker_id in WORKERS:
            assert table.own(chain_of(self.core, worker_id)) <= SLOTS

    @invariant()
    def only_placed_requests_and_those_being_reserved_hold_slots(self) -> None:
        reserving = {reserve.placement.request_id for reserve in self.pending}
        assert {request_id for request_id, *_ in self.core.router.table.held()} <= self.placed | reserving

    @invariant()
    def no_request_is_answered_twice(self) -> None:
        assert not [request_id for request_id, replies in self.replies.items() if replies > 1]

    def teardown(self) -> None:
        # Every reservation answered, every drain made, every deadline passed: each request has had its reply.
        for _ in range(100):
            while self.pending:
                self.run(self.core.confirmed(self.pending.pop(), True, -1, True))
            self.drain()
            if not self.pending and not self.drain_due and not len(self.core.router.queue):
                break
            self.tick(1000.0)
        assert {request_id: self.replies[request_id] for request_id in self.routed} == dict.fromkeys(self.routed, 1)


CoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCoreStateful = CoreMachine.TestCase
