"""The balancer in virtual time: the service's `BalancerCore`, its effects carried out in memory.

There is one balancer, so its slot table is the global count: a reservation
is always taken and counted by the table alone. The KV leases live in the
in-memory ledger (`SimAllocator`), which may preempt to make room. Replies go
to the `RouteListener` (the simulated ingress); I/O delays are the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from contracts.health import HealthVerdict
from contracts.messages import ErrorReply, Heartbeat, KvEvents, RouteRequest
from loadtest.simulation.events import EventQueue
from loadtest.simulation.ledger import SimAllocator
from services.balancer.allocation import demand_of
from services.balancer.building import build_router, fallback_step_model
from services.balancer.core import (
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
)
from services.balancer.router import Placement, Router
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
        router = build_router(settings, fallback_step_model(settings.speed.fallback_profile))
        router.builder.clock = lambda: events.now
        self.view = ClusterView(config.cluster.heartbeat_ttl_s)
        self.core = BalancerCore(router, lambda model: self.view.routable(events.now, model),
                                 lambda: self.view.live(events.now))
        self._events = events
        self._allocator = allocator
        self._generated = generated
        self._listener = listener
        self._tick_s = settings.tick_interval_s
        self._drain_due = False
        self._drain_again = False

    @property
    def router(self) -> Router:
        return self.core.router

    @property
    def decisions(self) -> int:
        return self.core.decisions

    @property
    def kv_refusals(self) -> int:
        return self.core.kv_refusals

    def start(self) -> None:
        self._events.after(self._tick_s, self._tick)

    # --- events in -----------------------------------------------------------------------

    def route(self, request: RouteRequest) -> None:
        self._run(self.core.route(request, self._events.now))

    def withdraw(self, request_id: str) -> None:
        """The client left or the request ended early: free what it holds here."""
        # The client that withdraws reads no reply, and stops its node itself.
        self._run([effect for effect in self.core.withdrawn(request_id) if not isinstance(effect, Refused)])

    def on_finished(self, request_id: str, worker_id: str, output_tokens: int | None = None) -> None:
        self._run(self.core.finished(request_id, worker_id, output_tokens))

    def on_heartbeat(self, heartbeat: Heartbeat) -> None:
        self.view.observe(heartbeat, self._events.now)
        self._run(self.core.heartbeat(heartbeat))

    def on_kv_events(self, events: KvEvents) -> None:
        self.core.kv_events(events)

    def on_health(self, verdict: HealthVerdict) -> None:
        self._run(self.core.health(verdict))

    def _tick(self) -> None:
        self._run(self.core.tick(self._events.now))
        self._events.after(self._tick_s, self._tick)

    def _drain(self) -> None:
        self._drain_due = False
        self._drain_again = True
        while self._drain_again:
            self._drain_again = False
            for reserve in self.core.dispatch():
                self._run(self._reserve(reserve))

    # --- effects out ---------------------------------------------------------------------

    def _run(self, effects: Iterable[Effect]) -> None:
        """Carry out `effects` in order; a `Reserve` comes last, and its answer's effects follow it."""
        while effects:
            answer: list[Effect] = []
            for effect in effects:
                kind = type(effect)
                if kind is Reserve:
                    answer += self._reserve(effect)  # type: ignore[arg-type]
                elif kind is Placed:
                    self._listener.placed(effect.placement)  # type: ignore[union-attr]
                elif kind is Refused:
                    self._listener.refused(effect.request_id, effect.reply)  # type: ignore[union-attr]
                elif kind is Preempted:
                    self._listener.preempted(effect.request_id)  # type: ignore[union-attr]
                elif kind is Release:
                    if self._allocator is not None:
                        self._allocator.ledger.release(effect.request_id, effect.worker_id)  # type: ignore[union-attr]
                    answer += self.core.released(())  # no other balancer: the table already counts it
                elif kind is Drain:
                    if not self._drain_due:
                        self._drain_due = True
                        self._events.after(0.0, self._drain)
                elif kind is Requeued:
                    self._drain_again = True
                elif kind is ReadUsage:
                    # The table is the global count: a chain taken as full after a KV refusal is tried again.
                    own = self.core.router.table.own
                    answer += self.core.counted({chain_id: own(chain_id) for chain_id in effect.chains})  # type: ignore[union-attr]
                elif kind is NodesGone and self._allocator is not None:
                    for worker_id in effect.worker_ids:  # type: ignore[union-attr]
                        self._allocator.ledger.release_node(worker_id)
                elif kind is ReleaseEarlier and self._allocator is not None:
                    # As the service's store does: the earlier attempt's lease goes with its slot (the table's).
                    for request_id, worker_id in effect.releases:  # type: ignore[union-attr]
                        self._allocator.ledger.release(request_id, worker_id)
                # Waiting: the reply comes later. Abort: the simulated ingress stops nodes itself. Charge: no other
                # balancer shares the tenants' counters.
            effects = answer

    def _reserve(self, reserve: Reserve) -> list[Effect]:
        """Take the placement's KV lease (its slot is the table's already)."""
        if self._allocator is None:
            return self.core.confirmed(reserve, True)
        placement = reserve.placement
        chain = placement.chain
        node = chain.node
        grant = self._allocator.allocate(demand_of(placement.request), node.worker_id, node.kv_blocks_total,
                                         node.block_size, chain.cached_blocks, self._generated, self._events.now)
        return self.core.confirmed(reserve, True, leased=grant.granted, preempted=grant.preempted)
