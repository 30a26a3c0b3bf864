"""Property-based invariants of the routing core (JFFC and every other policy behind it).

* a chain never runs more requests than its slots;
* within a priority class, requests start in arrival order;
* no request waits while a slot it could use is free;
* when every request has ended, no slot is held.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from contracts.messages import ErrorReply
from services.balancer.policies import POLICY_NAMES
from services.balancer.router import Placement, Queued
from services.balancer.snapshot import chain_id_of
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, request, router

WORKERS = ["a", "b", "c"]
BLOCKS_PER_SLOT = 64  # typical request 768 + 256 tokens at block size 16


class RouterMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(POLICY_NAMES),
        slots=st.lists(st.integers(1, 3), min_size=3, max_size=3),
        rates=st.lists(st.sampled_from([0.0, 100.0, 400.0]), min_size=3, max_size=3),
    )
    def setup(self, policy: str, slots: list[int], rates: list[float]) -> None:
        self.router = router(policy, queue_length=6)
        self.heartbeats = [
            heartbeat(w, blocks=s * BLOCKS_PER_SLOT, running=1 if r else 0, decode_tps=r) for w, s, r in zip(WORKERS, slots, rates)
        ]
        for hb in self.heartbeats:
            self.router.builder.observe(hb)
        self.slots = {chain_id_of(hb): s for hb, s in zip(self.heartbeats, slots)}
        self.worker_of = {chain_id_of(hb): hb.registration.worker_id for hb in self.heartbeats}
        self.running: dict[str, str] = {}  # request id -> chain id
        self.queued: dict[str, tuple[int, int, frozenset[str]]] = {}  # request id -> (priority, arrival, excluded)
        self.arrivals = 0
        self.now = NOW_WALL

    def heartbeats_for(self, model: str):
        return self.heartbeats

    def record(self, placement: Placement) -> None:
        chain_id = placement.chain.chain_id
        assert self.router.table.used(chain_id) <= self.slots[chain_id], "chain oversubscribed"
        assert placement.chain.worker_id not in placement.request.exclude_workers
        self.running[placement.request_id] = chain_id

    def dispatch(self) -> None:
        placed = self.router.dispatch_queued(self.heartbeats_for)
        order = [(-e.request.priority, e.seq) for e, _ in placed]
        assert order == sorted(order), "dispatched out of priority/FIFO order"
        for entry, placement in placed:
            priority, arrival, excluded = self.queued.pop(entry.request_id)
            if not excluded:
                # FIFO within the class: no earlier unrestricted request of this class (or a higher one) still waits.
                for p, a, ex in self.queued.values():
                    assert not (not ex and (p > priority or (p == priority and a < arrival))), "FIFO violated"
            self.record(placement)

    @rule(priority=st.integers(0, 1), exclude=st.sets(st.sampled_from(WORKERS), max_size=2))
    def arrive(self, priority: int, exclude: set[str]) -> None:
        self.arrivals += 1
        request_id = f"r{self.arrivals}"
        req = request(request_id, priority=priority, exclude=sorted(exclude), timeout_s=100.0)
        outcome = self.router.admit(req, self.heartbeats, self.now)
        match outcome:
            case Placement():
                self.record(outcome)
            case Queued(evicted=evicted):
                if evicted is not None:
                    # A full queue made room: the newest request of the lowest class below this one left it.
                    victim = self.queued.pop(evicted.request_id)
                    lowest = min(p for p, _, _ in [*self.queued.values(), victim])
                    assert victim[0] < priority and victim[0] == lowest
                    assert victim[1] == max(seq for p, seq, _ in [*self.queued.values(), victim] if p == victim[0])
                self.queued[request_id] = (priority, self.arrivals, frozenset(exclude))
            case ErrorReply():
                assert outcome.status == 503 and outcome.retry_after_s
                assert len(self.queued) == 6 and all(p >= priority for p, _, _ in self.queued.values())

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        request_id = sorted(self.running)[index % len(self.running)]
        del self.running[request_id]
        assert self.router.table.release(request_id) is not None
        assert self.router.table.release(request_id) is None  # idempotent
        self.dispatch()

    @rule()
    def finish_everything(self) -> None:
        while self.running:
            self.finish(0)
        # Requests excluded from every chain would wait for ever: they time out.
        for entry in self.router.queue.expire(self.now + 1000):
            del self.queued[entry.request_id]
        assert self.router.table.total_used() == 0
        assert len(self.router.queue) == 0

    @invariant()
    def slots_never_oversubscribed(self) -> None:
        if not hasattr(self, "router"):
            return
        for chain_id, slots in self.slots.items():
            assert self.router.table.used(chain_id) <= slots
        assert self.router.table.total_used() == len(self.running)

    @invariant()
    def nobody_waits_beside_a_usable_free_slot(self) -> None:
        if not hasattr(self, "router"):
            return
        for request_id, (_, _, excluded) in self.queued.items():
            for chain_id, slots in self.slots.items():
                usable = self.worker_of[chain_id] not in excluded and self.router.table.used(chain_id) < slots
                assert not usable, f"{request_id} waits while {chain_id} has a free slot"


RouterMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestRouterInvariants = RouterMachine.TestCase
