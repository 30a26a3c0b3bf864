"""The balancer in virtual time: the service's `Router` (policy, slots, central queue) with events for I/O.

What `services.balancer.service` does around the router is repeated here
event for event, without NATS or Redis: a route request is placed at once
or queued; each placement takes its KV lease (refused: the chain counts as
full and the policy chooses again); a `RequestFinished`, a heartbeat, a
health verdict or a tick offers freed slots to the queue; the tick expires
reservations and queued requests and forgets nodes that left. There is one
balancer, so its slot table is the global count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from contracts.health import HealthVerdict
from contracts.messages import ErrorReply, Heartbeat, KvEvents, RouteRequest
from loadtest.simulation.events import EventQueue
from loadtest.simulation.ledger import SimAllocator
from services.balancer.allocation import demand_of
from services.balancer.central_queue import QueuedRequest
from services.balancer.main import build_router, fallback_step_model
from services.balancer.router import Placement, Queued
from shared.cluster import ClusterView
from shared.config import KvlaneConfig


class RouteListener(Protocol):
    def placed(self, placement: Placement) -> None: ...

    def refused(self, request_id: str, reply: ErrorReply) -> None: ...

    def preempted(self, request_id: str) -> None: ...


class SimBalancer:
    def __init__(self, config: KvlaneConfig, events: EventQueue, allocator: SimAllocator | None,
                 generated: Callable[[str], int], listener: RouteListener) -> None:
        settings = config.balancer
        self.router = build_router(settings, fallback_step_model(settings.speed.fallback_profile))
        self.router.builder.clock = lambda: events.now
        self.view = ClusterView(config.cluster.heartbeat_ttl_s)
        self._events = events
        self._allocator = allocator
        self._generated = generated
        self._listener = listener
        self._tick_s = settings.tick_interval_s
        self._drain_due = False
        self.decisions = 0
        self.kv_refusals = 0

    def start(self) -> None:
        self._events.after(self._tick_s, self._tick)

    # --- routing -------------------------------------------------------------------

    def route(self, request: RouteRequest) -> None:
        now = self._events.now
        router = self.router
        if request.timeout_s <= 0:
            return self._listener.refused(request.request_id, ErrorReply(code="deadline_exceeded", message="request deadline passed before routing", status=504))
        router.table.release(request.request_id)
        heartbeats = self.view.routable(now, request.model)
        refusal = router.unroutable(request, heartbeats, lambda: self.view.live(now))
        if refusal is not None:
            return self._listener.refused(request.request_id, refusal)
        for _ in range(len(heartbeats) + 1):
            outcome = router.admit(request, heartbeats, now)
            self.decisions += 1
            if isinstance(outcome, Placement):
                if self._confirm(outcome, None):
                    return self._listener.placed(outcome)
                continue
            if isinstance(outcome, Queued):
                if outcome.evicted is not None:
                    self._listener.refused(outcome.evicted.request_id, router.degradation.evicted_reply(outcome.evicted))
                return None
            return self._listener.refused(request.request_id, outcome)
        self._listener.refused(request.request_id, router.refusal("no_capacity", "no chain had room for this request's KV"))

    def withdraw(self, request_id: str) -> None:
        """The client left or the request ended early: free what it holds here."""
        self.router.queue.remove(request_id)
        self.router.table.release(request_id)
        if self._allocator is not None:
            self._allocator.ledger.release(request_id)
        self._schedule_drain()

    def _confirm(self, placement: Placement, entry: QueuedRequest | None) -> bool:
        if self._allocator is None:
            return True
        request, chain = placement.request, placement.chain
        node = chain.node
        demand = demand_of(request)
        grant = self._allocator.allocate(demand, node.worker_id, node.kv_blocks_total, node.block_size,
                                         chain.cached_blocks, self._generated, self._events.now)
        for victim in grant.preempted:
            self.router.table.release(victim)
            self._listener.preempted(victim)
        if grant.granted:
            return True
        self.kv_refusals += 1
        self.router.undo(placement, node.slots_total, entry)
        return False

    def _schedule_drain(self) -> None:
        if not self._drain_due and len(self.router.queue):
            self._drain_due = True
            self._events.after(0.0, self._drain)

    def _drain(self) -> None:
        self._drain_due = False
        again = True
        while again:
            again = False
            for entry, placement in self.router.dispatch_queued(lambda model: self.view.routable(self._events.now, model)):
                self.decisions += 1
                if not self._confirm(placement, entry):
                    again = True
                    continue
                self._listener.placed(placement)

    # --- events ---------------------------------------------------------------------

    def on_finished(self, request_id: str, worker_id: str) -> None:
        self.router.finished(request_id, worker_id)
        if self._allocator is not None:
            self._allocator.ledger.release(request_id, worker_id)
        self._schedule_drain()

    def on_heartbeat(self, heartbeat: Heartbeat) -> None:
        self.view.observe(heartbeat, self._events.now)
        self.router.observe(heartbeat)
        self._schedule_drain()

    def on_kv_events(self, events: KvEvents) -> None:
        self.router.index.apply(events.worker_id, events.stored, events.removed, events.cleared)

    def on_health(self, verdict: HealthVerdict) -> None:
        self.router.builder.set_health_weight(verdict.worker_id, verdict.weight)
        self._schedule_drain()

    def _tick(self) -> None:
        now = self._events.now
        router = self.router
        table = router.table
        _, gone = router.prune(now, self.view.live(now))
        if self._allocator is not None:
            for worker_id in gone:
                self._allocator.ledger.release_node(worker_id)
        # The store's count is this balancer's own: a chain marked full after a KV refusal is tried again.
        for chain_id in table.chains():
            table.set_global_used(chain_id, table.own(chain_id))
        for entry in router.queue.expire(now):
            self._listener.refused(entry.request_id, router.refusal("queue_timeout", "no slot freed before the deadline"))
        self._schedule_drain()
        self._events.after(self._tick_s, self._tick)
