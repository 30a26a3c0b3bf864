"""The balancer service: NATS and the slot store wired to the routing core.

Any number of balancers share the `kvlane.v1.route` queue group. A route
request is placed at once when a suitable chain has a free slot, or waits
in this process's central queue (the reply is sent when a slot frees, or a
503 with Retry-After at the queue deadline). Each placement is confirmed
with the global slot store, so replicas never oversubscribe a chain.
Every replica hears every `RequestFinished` and releases that request's
slot (idempotent), so a freed slot is visible to all of them at once, and
a crashed replica's reservations are still released. The store's release
frees the request's KV lease too (`slot_store`): the balancers take and free
every lease, and the cache-managers only reap those nobody freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
import redis.exceptions
import structlog
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Tracer
from prometheus_client import Counter, Gauge

from contracts import subjects
from contracts.autoscaler import ScaleUpWanted
from contracts.balancer import BalancerStatusReply, BalancerStatusRequest
from contracts.health import HealthVerdict
from contracts.messages import (
    AbortRequest,
    ErrorReply,
    Heartbeat,
    KvEvents,
    RequestFinished,
    RouteDecision,
    RouteReply,
    RouteRequest,
    RouteWithdrawn,
    WorkerLeft,
)
from services.balancer.allocation import KvAllocator, LeaseCall, Unleased
from services.balancer.central_queue import QueuedRequest
from services.balancer.core import (
    Abort,
    BalancerCore,
    Charge,
    Drain,
    Effect,
    Placed,
    ReadUsage,
    Refused,
    Release,
    ReleaseEarlier,
    Requeued,
    Reserve,
    Waiting,
)
from services.balancer.from_zero import FromZero, WakeAutoscaler
from services.balancer.metrics import BalancerMetrics
from services.balancer.prefix_pull import PrefixPull
from services.balancer.presence import ReplicaPresence
from services.balancer.router import Placement, Router
from services.balancer.slot_store import RedisSlotStore, SlotStore
from services.balancer.status import SlotRates, build_status
from services.balancer.trackers import ArrivalRate
from shared.kv.block_ledger import Reservation
from shared.bus import Bus
from shared.cluster import ClusterView
from shared.config import BalancerSettings
from shared.coalescer import Coalescer
from services.balancer.log_throttle import LogThrottle
from shared.periodic import Periodic
from shared.telemetry import set_error

log = structlog.get_logger("kvlane.balancer")

_STORE_ERRORS = (redis.exceptions.RedisError, OSError, asyncio.TimeoutError)
_UNLEASED_LOG_EVERY_S = 10.0
# How long one model's routable nodes are reused between heartbeats: listing them walks the whole fleet, and
# a burst of route requests would otherwise do it once each. Small against the heartbeat TTL.
_ROUTABLE_REUSE_S = 0.05


class BalancerService:
    def __init__(
        self,
        bus: Bus,
        view: ClusterView,
        router: Router,
        store: SlotStore,
        settings: BalancerSettings,
        metrics: BalancerMetrics,
        rates: SlotRates,
        allocator: KvAllocator | None = None,
        balancer_id: str = "balancer",
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        tracer: Tracer | None = None,
        heartbeat_interval_s: float = 1.0,
        from_zero: FromZero | None = None,
    ) -> None:
        self._bus = bus
        self._view = view
        self._tracer = tracer or trace.NoOpTracer()
        self._tracing = not isinstance(self._tracer, trace.NoOpTracer)
        # The trace of each queued request: its placement (and KV allocation) happen in the drain task.
        self._waiting_traces: dict[str, otel_context.Context] = {}
        self.router = router
        # The decisions: this service carries out their effects over NATS and the store.
        self.core = BalancerCore(router, self._routable, lambda: self._view.live(self._clock()), from_zero,
                                 shares_counters=isinstance(store, RedisSlotStore))
        # Models with requests waiting for a worker at the last tick (their gauges go back to 0 when none waits).
        self._held_models: set[str] = set()
        self._store = store
        self._settings = settings
        self._metrics = metrics
        self._rates = rates
        self._allocator = allocator
        self._balancer_id = balancer_id
        self._clock = clock
        self._wall_clock = wall_clock
        self._arrivals = ArrivalRate(settings.speed.smoothing, wall_clock())
        self._waiters: dict[str, asyncio.Future[RouteReply]] = {}
        self._drain_task: asyncio.Task | None = None
        self._drain_again = False
        self._ticker = Periodic("balancer-tick", settings.tick_interval_s, self.tick)
        self._presence = ReplicaPresence(bus, balancer_id, heartbeat_interval_s, self._on_route)
        self._fast_forwards_seen = 0
        self._cache_holds_seen = 0
        # A placed request's prefix pull, as its route span is to show it (only while tracing).
        self._pull_attributes: dict[str, dict[str, str | int | float]] = {}
        # Each live chain's slot gauges (used, total): a label lookup per chain and tick costs more than the tick's reads.
        self._gauged_chains: dict[str, tuple[Gauge, Gauge]] = {}
        self._store_degraded = False
        # Routes without a KV lease: one log line per reason per interval, each saying how many it stands for.
        self._unleased_log = LogThrottle(_UNLEASED_LOG_EVERY_S)
        # Slots of finished requests are freed here at once and in the global store a batch at a time.
        # Each: (request, its node, the chain this replica placed it on or None).
        self._finished: Coalescer[tuple[str, str, str | None]] = Coalescer("slot-releases", self._release_globally)
        # Per model: (reuse until, its routable nodes); emptied whenever a heartbeat or a departure changes them.
        self._routable_nodes: dict[str, tuple[float, list[Heartbeat]]] = {}
        self._decision_counters: dict[str, Counter] = {}
        # Read once: a filtered-out `log.debug` still costs microseconds through structlog's lazy proxy, on every route.
        self._logs_routes = _logs_debug(log)

    async def start(self) -> None:
        bus = self._bus
        # These two only update memory (the release batch goes out later): handled as nats-py reads them. Before
        # the first heartbeat: workers answer a new replica's first one with the finished events it may have missed.
        await bus.subscribe(subjects.REQUEST_FINISHED, RequestFinished, self._on_finished, traced=False, at_once=True)
        await bus.subscribe(subjects.ROUTE_WITHDRAWN, RouteWithdrawn, self._on_withdrawn)
        await bus.subscribe(subjects.KV_EVENTS_ALL, KvEvents, self._on_kv_events, traced=False, at_once=True)
        await bus.subscribe(subjects.HEALTH_ALL, HealthVerdict, self._on_health, traced=False)
        await bus.subscribe(subjects.WORKER_LEFT, WorkerLeft, self._on_worker_left, traced=False)
        await bus.subscribe(
            subjects.BALANCER_STATUS, BalancerStatusRequest, self._on_status, queue=subjects.BALANCER_ADMIN_QUEUE_GROUP
        )
        await bus.subscribe(subjects.BALANCER_STATUS_ALL, BalancerStatusRequest, self._on_status)
        await self._presence.start()
        self._ticker.start()

    async def stop(self) -> None:
        """Take no more route requests, then refuse every queued one (no client waits on a balancer that is going away)."""
        await self._presence.stop()
        await self._ticker.stop()
        await self._finished.close()
        if self._allocator is not None:
            await self._allocator.close()
        for request_id in list(self._waiters):
            self.router.queue.remove(request_id)
            self._resolve(request_id, self.router.refusal("balancer_stopping", "the balancer is shutting down"))

    # --- routing -------------------------------------------------------------------

    async def _on_route(self, request: RouteRequest, msg: Msg) -> RouteReply:
        if not self._tracing:
            reply = await self.route(request)
        else:
            attributes = {"kvlane.request_id": request.request_id, "gen_ai.request.model": request.model,
                          "kvlane.route.prompt_tokens": request.prompt_tokens, "kvlane.priority": request.priority}
            if request.tenant:
                attributes["kvlane.tenant"] = request.tenant
            if request.adapter:
                attributes["kvlane.adapter"] = request.adapter
            if request.exclude_workers:
                attributes["kvlane.route.excluded"] = request.exclude_workers
            with self._tracer.start_as_current_span("route", attributes=attributes) as span:
                reply = await self.route(request)
                if isinstance(reply, ErrorReply) and span.is_recording():
                    set_error(span, reply.code, reply.message)  # also the refusals made before any policy ran
        if request.hand_over is not None and isinstance(reply, RouteDecision):
            reply = await self._hand_over(request, reply, msg)
        return reply

    async def _hand_over(self, request: RouteRequest, decision: RouteDecision, msg: Msg) -> RouteDecision:
        """Send the route request's `hand_over` on to the chosen worker, where it can go as it is.

        Not to a two-node chain (the prefill node's request names the decode node), not degraded (fewer
        tokens), and not once withdrawn: then the ingress hands the request over itself.
        """
        hand_over = request.hand_over
        assert hand_over is not None
        if (decision.prefill_inbox or decision.max_tokens != request.max_tokens
                or self.router.table.holder(request.request_id) is None):
            return decision
        if decision.queued_s:
            hand_over = msgspec.structs.replace(hand_over, timeout_s=max(0.0, hand_over.timeout_s - decision.queued_s))
        try:
            # In the sender's trace: the worker's spans are children of the ingress's attempt, as when it sends.
            # The worker answers to `accept_to`; NATS's no-responders status, which comes to the sender only,
            # is passed on there.
            await self._bus.publish(decision.inbox, hand_over, context=self._bus.sender_context(msg),
                                    reply=await self._bus.relaying_to(hand_over.accept_to))
        except Exception as exc:  # NATS trouble: the ingress can still send it
            log.warning("hand_over_failed", request_id=request.request_id, error=str(exc))
            return decision
        return msgspec.structs.replace(decision, handed_over=True)

    async def route(self, request: RouteRequest) -> RouteReply:
        self._arrivals.arrived()
        superseded = self._waiters.pop(request.request_id, None)
        if superseded is not None and not superseded.done():
            superseded.set_result(ErrorReply(code="superseded", message="a newer route request has the same id", status=409))
        started = time.perf_counter()
        effects = self.core.route(request, self._wall_clock())
        self._metrics.decision_seconds.observe(time.perf_counter() - started)
        # The last effect is the request's own: a reservation to make, its reply, or its wait in the queue.
        while True:
            for index in range(len(effects) - 1):
                await self._carry_out(effects[index])
            last = effects[-1]
            kind = type(last)
            if kind is Reserve:
                effects = await self._confirm(last)  # type: ignore[arg-type]
            elif kind is Placed:
                return self._count(self._decision(last), "placed")  # type: ignore[arg-type]
            elif kind is Waiting:
                return self._count(await self._wait(last.entry), "queued")  # type: ignore[union-attr]
            else:
                return self._count(last.reply, "refused")  # type: ignore[union-attr]

    def _count(self, reply: RouteReply, outcome: str) -> RouteReply:
        if isinstance(reply, ErrorReply) and outcome != "refused":
            outcome = f"{outcome}_refused"
        counter = self._decision_counters.get(outcome)
        if counter is None:
            counter = self._decision_counters[outcome] = self._metrics.decisions.labels(self.router.policy.name, outcome)
        counter.inc()
        if self._tracing:
            span = trace.get_current_span()  # the request's `route` span
            pulled = self._pull_attributes.pop(reply.request_id, None) if isinstance(reply, RouteDecision) else None
            if span.is_recording():
                _annotate_route(span, reply, outcome, self.router.policy.name)
                if pulled is not None:
                    span.set_attributes(pulled)
        return reply

    def _decision(self, placed: Placed) -> RouteDecision:
        placement, entry = placed.placement, placed.entry
        chain, pull = placement.chain, placement.pull
        # A prefix pull's source is the chain's first node, as a prefill node is.
        first = pull.source if pull is not None else placement.prefill.node if placement.prefill is not None else None
        if placement.pull_choice and self._tracing:
            # For the request's `route` span, which the reply is annotated on: a queued request is placed outside it.
            if len(self._pull_attributes) > _MOST_PULL_ATTRIBUTES:  # replies that never reached their span
                self._pull_attributes.clear()
            self._pull_attributes[placement.request_id] = pull_attributes(placement.pull_choice, pull)
        return RouteDecision(
            placement.request_id, chain.worker_id, chain.node.inbox, self.router.policy.name, chain.cached_blocks,
            prefill_worker_id=first.worker_id if first else "", prefill_inbox=first.inbox if first else "",
            prefix_tokens=pull.exposed_tokens if pull is not None else 0,
            queued_s=0.0 if entry is None else max(0.0, self._wall_clock() - entry.enqueued_at),
            max_tokens=placement.request.max_tokens, started_at=chain.node.started_at,
        )

    async def _confirm(self, reserve: Reserve) -> list[Effect]:
        """Take the placement's slot and KV lease in the store (both or neither); the core's effects of the answer."""
        placement = reserve.placement
        chain = placement.chain
        reserved = None
        try:
            taken, used, reserved = await self._reserve(placement)
        except _STORE_ERRORS as exc:
            # Availability over strictness: while Redis is down each replica
            # enforces the slots on what it knows (its own reservations plus
            # the last known foreign counts); its holds are written back once
            # Redis answers again (`tick`).
            if not self._store_degraded:
                log.warning("slot_store_unavailable_using_local_counts", error=str(exc))
            self._store_degraded = True
            taken, used = True, -1
        leased = True
        if taken and self._allocator is not None:
            allocation = await self._allocator.allocate(placement.request, chain, reserved)
            if isinstance(allocation, Unleased):
                # Redis or the cache-manager is out of reach: as with slots,
                # availability wins; the engine's own KV admission still
                # bounds the node, and leases resume once they answer.
                self._unleased(allocation, placement.request_id)
            elif isinstance(allocation, ErrorReply):
                leased = False
                await self._give_back(placement)
        if not (taken and leased):
            self._metrics.slot_conflicts.inc()
            started = time.perf_counter()
            effects = self.core.confirmed(reserve, taken, used, leased)
            if reserve.entry is None:  # placed again
                self._metrics.decision_seconds.observe(time.perf_counter() - started)
            return effects
        if self._logs_routes:
            log.debug("routed", request_id=placement.request_id, worker_id=chain.worker_id, slots_used=used,
                      cached_blocks=chain.cached_blocks)
        if self._tracing:
            span = trace.get_current_span()  # the request's `route` span, also in the drain task
            if span.is_recording():
                span.set_attributes({"kvlane.route.chain_id": chain.chain_id, "kvlane.route.fast_forward": placement.fast_forward,
                                     "kvlane.route.slots_used": used})
        return self.core.confirmed(reserve, taken, used, leased)

    async def _give_back(self, placement: Placement) -> None:
        """The slot a refused lease leaves taken (the store took it alone): a reservation is both or neither."""
        try:
            await self._store.release_many([(placement.request_id, placement.chain.worker_id)], [placement.chain.chain_id])
        except _STORE_ERRORS as exc:
            log.debug("slot_release_failed", request_id=placement.request_id, error=str(exc))
            self._store_degraded = True

    def _unleased(self, unleased: Unleased, request_id: str) -> None:
        self._metrics.unleased_routes.labels(unleased.reason).inc()
        count = self._unleased_log.due(unleased.reason, self._clock())
        if count:
            log.warning("routed_without_kv_lease", reason=unleased.reason, detail=unleased.detail, routes=count,
                        request_id=request_id)

    async def _reserve(self, placement: Placement) -> tuple[bool, int, tuple[LeaseCall, Reservation] | None]:
        """The chain's slot in the store and, where the store and the ledger share Redis, the KV lease in the same
        round trip: (slot taken, chain's count, the ledger's answer if it was asked)."""
        chain, request = placement.chain, placement.request
        lease = None
        if self._allocator is not None and isinstance(self._store, RedisSlotStore):
            lease = self._allocator.lease_call(request, chain)
        if lease is None:
            return *await self._store.reserve(placement.request_id, chain.chain_id, chain.node.slots_total, placement.expires_at), None
        both = await self._store.reserve_with_lease(placement.request_id, chain.chain_id, chain.node.slots_total,
                                                    placement.expires_at, (lease.keys, lease.args))
        if both.lease is None or both.lease.granted:
            return both.slot_taken, both.used, None if both.lease is None else (lease, both.lease)
        # No KV room on the node: the slot alone, while the cache-manager looks for room (it may preempt).
        taken, used = await self._store.reserve(placement.request_id, chain.chain_id, chain.node.slots_total, placement.expires_at)
        return taken, used, (lease, both.lease)

    async def _wait(self, entry: QueuedRequest) -> RouteReply:
        future: asyncio.Future[RouteReply] = asyncio.get_running_loop().create_future()
        self._waiters[entry.request_id] = future
        self._waiting_traces[entry.request_id] = otel_context.get_current()
        self._metrics.queue_length.set(len(self.router.queue))
        try:
            return await asyncio.wait_for(future, max(0.0, entry.deadline - self._wall_clock()))
        except asyncio.TimeoutError:
            self._metrics.queue_wait.labels("timeout").observe(self._wall_clock() - entry.enqueued_at)
            return self.core.queue_deadline(entry).reply
        finally:
            if self._waiters.get(entry.request_id) is future:
                del self._waiters[entry.request_id]
                self._waiting_traces.pop(entry.request_id, None)
            self._metrics.queue_length.set(len(self.router.queue))

    def _resolve(self, request_id: str, reply: RouteReply) -> bool:
        future = self._waiters.get(request_id)
        if future is None or future.done():
            return False
        future.set_result(reply)
        return True

    def _schedule_drain(self) -> None:
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_again = True
            return
        if len(self.router.queue):
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """Hand free slots to queued requests until none fits (re-runs if more slots freed meanwhile)."""
        self._drain_again = True
        while self._drain_again:
            self._drain_again = False
            # Confirmed together, not one after another: their reservations share one round trip to the store
            # (`ScriptBatch`), so a full fleet serves its queue at the store's batch rate, not one request per trip.
            await asyncio.gather(*(self._serve_queued(reserve) for reserve in self.core.dispatch()))
        self._metrics.queue_length.set(len(self.router.queue))

    async def _serve_queued(self, reserve: Reserve) -> None:
        entry = reserve.entry
        assert entry is not None
        # Its placement and allocation belong to the queued request's trace, not to whatever woke the drain.
        token = otel_context.attach(self._waiting_traces.get(entry.request_id, otel_context.Context()))
        try:
            effects = await self._confirm(reserve)
        finally:
            otel_context.detach(token)
        await self._carry_out_all(effects)

    # --- effects ----------------------------------------------------------------------

    async def _carry_out_all(self, effects: list[Effect]) -> None:
        for effect in effects:
            await self._carry_out(effect)

    async def _carry_out(self, effect: Effect) -> None:
        """One effect of an event (a route request's own reply and reservations are `route`'s)."""
        match effect:
            case Refused(request_id=request_id, reply=reply):
                self._resolve(request_id, reply)
            case Placed(entry=entry) if entry is not None:
                self._metrics.queue_wait.labels("served").observe(self._wall_clock() - entry.enqueued_at)
                if not self._resolve(entry.request_id, self._decision(effect)):
                    # The client gave up while the slot was being confirmed.
                    await self._carry_out_all(self.core.unanswered(entry.request_id))
            case Requeued():
                self._drain_again = True  # that chain is now known full; others may still fit
            case Drain():
                self._schedule_drain()
            case Release(request_id=request_id, worker_id=worker_id, chain_id=chain_id):
                released: list[tuple[str, int] | None] = []
                if worker_id is not None:
                    try:
                        released = await self._store.release_many([(request_id, worker_id)], [chain_id])
                    except _STORE_ERRORS as exc:
                        log.debug("slot_release_failed", request_id=request_id, error=str(exc))
                        self._store_degraded = True
                # Not before the store freed it: another replica could not take it yet, nor could this one.
                self._carry_out_now(self.core.released(released))
            case Charge(charge=charge):
                self._store.charge(charge)
            case ReleaseEarlier(releases=releases, chains=chains):
                with contextlib.suppress(*_STORE_ERRORS):
                    await self._store.release_many(releases, chains)
            case WakeAutoscaler():
                await self._wake(effect)
            case Abort(request_id=request_id, worker_id=worker_id):
                # This replica may have handed the request over before its route reply reached a client that had
                # left; a worker that never got it ignores the abort.
                with contextlib.suppress(Exception):
                    await self._bus.publish(subjects.worker_inbox(worker_id),
                                            AbortRequest(request_id=request_id, reason="client_disconnected"))
            case _:
                self._carry_out_now([effect])

    async def _wake(self, wake: WakeAutoscaler) -> None:
        """Ask the autoscaler for a worker of the model; lost, the next tick's wake asks again."""
        try:
            await self._bus.publish(subjects.AUTOSCALER_WAKE, ScaleUpWanted(wake.model, wake.held, self._balancer_id))
        except Exception as exc:  # NATS trouble: the held requests wait on, and the next tick tries again
            log.warning("autoscaler_wake_failed", model=wake.model, error=str(exc))
            return
        log.info("autoscaler_woken", model=wake.model, held=wake.held)

    def _carry_out_now(self, effects: list[Effect]) -> None:
        """The effects that need no I/O: replies and drains."""
        for effect in effects:
            if type(effect) is Drain:
                self._schedule_drain()
            elif type(effect) is Refused:
                self._resolve(effect.request_id, effect.reply)  # type: ignore[union-attr]
            # NodesGone: the core forgot them; Preempted: the cache-manager stops what it preempts.

    # --- events ---------------------------------------------------------------------

    def _on_finished(self, event: RequestFinished, msg: Msg) -> None:
        for effect in self.core.finished(event.request_id, event.worker_id, event.usage.completion_tokens):
            if isinstance(effect, Charge):
                self._store.charge(effect.charge)
                continue
            assert isinstance(effect, Release) and effect.worker_id is not None
            self._finished.put((effect.request_id, effect.worker_id, effect.chain_id))

    async def _release_globally(self, finished: list[tuple[str, str, str | None]]) -> None:
        """Free finished requests' slots and KV leases in the store, then give the slots to queued requests."""
        releases = [(request_id, worker_id) for request_id, worker_id, _ in finished]
        try:
            released = await self._store.release_many(releases, [chain_id for *_, chain_id in finished])
        except _STORE_ERRORS as exc:
            log.debug("slot_release_failed", requests=len(releases), error=str(exc))
            self._store_degraded = True
            released = []
        # Not before the store freed them: another replica could not take them yet, nor could this one.
        self._carry_out_now(self.core.released(released))

    async def _on_withdrawn(self, event: RouteWithdrawn, msg: Msg) -> None:
        # Every replica hears it: the one holding the request queued, and whichever holds its slot. Not placed by
        # this replica, its slot is the placing one's to free (the store finds a slot only through its node). Missed,
        # it goes at the request's deadline, and its lease when it lapses unrenewed and is reaped.
        await self._carry_out_all(self.core.withdrawn(event.request_id))

    def heard(self, heartbeat: Heartbeat) -> None:
        """A heartbeat the cluster watcher just recorded in the view (`ClusterWatcher.add_heartbeat_listener`)."""
        # The routable nodes listed next must include it.
        self._routable_nodes.clear()
        self._carry_out_now(self.core.heartbeat(heartbeat))

    def _on_kv_events(self, events: KvEvents, msg: Msg) -> None:
        self.core.kv_events(events)

    async def _on_health(self, verdict: HealthVerdict, msg: Msg) -> None:
        self._carry_out_now(self.core.health(verdict))

    async def _on_worker_left(self, event: WorkerLeft, msg: Msg) -> None:
        self._view.remove(event.worker_id)  # as the cluster watcher does, maybe later: routes must not go there now
        self._routable_nodes.clear()
        self.core.worker_left(event.worker_id)

    # --- housekeeping -----------------------------------------------------------------

    async def tick(self) -> None:
        """Expire reservations and queued requests, drop nodes that left, re-read the global usage of chains no
        reservation counted since the last tick, retry the queue."""
        now = self._wall_clock()
        expired = self.core.expired
        effects = self.core.tick(now)
        self._routable_nodes.clear()
        self._metrics.expired_reservations.inc(self.core.expired - expired)
        for effect in effects:
            if isinstance(effect, ReadUsage):
                await self._read_usage(effect.chains, now)
            else:
                self._carry_out_now([effect])
        self._metrics.arrival_rate.set(self._arrivals.tick(now))
        fast_forwards = self.router.policy.fast_forwards
        self._metrics.fast_forwards.inc(fast_forwards - self._fast_forwards_seen)
        self._fast_forwards_seen = fast_forwards
        self._metrics.cache_holds.inc(self.router.cache_holds - self._cache_holds_seen)
        self._cache_holds_seen = self.router.cache_holds
        self._metrics.queue_length.set(len(self.router.queue))
        if self.router.shares is not None:
            self._metrics.track_tenants(self.router.queue.waiting_per_tenant(), self.router.shares.counter)
        await self._held_from_zero(now)
        table, facts = self.router.table, self.router.builder.facts
        live_chains = {facts(hb).chain_id: hb for hb in self._view.live(self._clock())}
        for chain_id in self._gauged_chains.keys() - live_chains.keys():
            del self._gauged_chains[chain_id]
            self._metrics.slots_used.remove(chain_id)
            self._metrics.slots_total.remove(chain_id)
        for chain_id, heartbeat in live_chains.items():
            gauges = self._gauged_chains.get(chain_id)
            if gauges is None:
                gauges = self._gauged_chains[chain_id] = (self._metrics.slots_used.labels(chain_id),
                                                          self._metrics.slots_total.labels(chain_id))
            gauges[0].set(table.used(chain_id))
            gauges[1].set(facts(heartbeat).slots_total)

    async def _held_from_zero(self, now: float) -> None:
        """Export the requests waiting for a worker per model, and wake the autoscaler again for them."""
        from_zero = self.core.from_zero
        held = from_zero.waiting(self.router.queue, self._routable)
        for model in self._held_models - held.keys():
            self._metrics.held_from_zero.labels(model).set(0)
        for model, count in held.items():
            self._metrics.held_from_zero.labels(model).set(count)
        self._held_models = set(held)
        for wake in from_zero.due(now, held):
            await self._wake(wake)

    async def _read_usage(self, chains: list[str], now: float) -> None:
        try:
            if self._store_degraded:
                await self._restore_holds()
            usage, counters = await self._store.usage_and_counters(chains, now)
        except _STORE_ERRORS as exc:
            if not self._store_degraded:
                log.warning("slot_usage_read_failed", error=str(exc))
            self._store_degraded = True
            usage, counters = {}, None
        self._carry_out_now(self.core.counted(usage, counters))

    async def _restore_holds(self) -> None:
        """Write this replica's reservations back to the store (after an outage or a Redis restart lost them)."""
        for request_id, chain_id, expires_at in self.router.table.held():
            # No limit: these requests already run; the store must count them, not judge them.
            await self._store.reserve(request_id, chain_id, 1 << 30, expires_at)
        self._store_degraded = False
        log.info("slot_store_restored", reservations=len(self.router.table))

    def _routable(self, model: str) -> list[Heartbeat]:
        now = self._clock()
        reused = self._routable_nodes.get(model)
        if reused is not None and now < reused[0]:
            return reused[1]
        heartbeats = self._view.routable(now, model)
        self._routable_nodes[model] = (now + _ROUTABLE_REUSE_S, heartbeats)
        return heartbeats

    # --- admin ------------------------------------------------------------------------

    async def _on_status(self, request: BalancerStatusRequest, msg: Msg) -> BalancerStatusReply:
        return build_status(
            balancer_id=self._balancer_id,
            slot_store=self._settings.slots.store,
            router=self.router,
            heartbeats=[hb for hb in self._view.live(self._clock()) if not hb.draining],
            rates=self._rates,
            arrival_rate=self._arrivals.per_second,
            now=self._wall_clock(),
            fast_forwards=self.router.policy.fast_forwards,
            model=request.model,
            block_hashes=request.block_hashes,
        )


def _logs_debug(logger: structlog.typing.BindableLogger) -> bool:
    """Whether `logger` writes debug lines as logging is configured now (yes when it cannot tell)."""
    is_enabled_for = getattr(logger.bind(), "is_enabled_for", None)
    return True if is_enabled_for is None else bool(is_enabled_for(logging.DEBUG))


# Route spans waiting for their prefix pull's attributes, at most (each is popped as its reply is annotated).
_MOST_PULL_ATTRIBUTES = 10_000


def pull_attributes(choice: str, pull: PrefixPull | None) -> dict[str, str | int | float]:
    """What was chosen for a request a node could have pulled the prefix for; a pull's source, size and the costs it
    was chosen on."""
    if pull is None:
        return {"kvlane.route.choice": choice}
    return {
        "kvlane.route.choice": choice,
        "kvlane.prefix_pull.source.id": pull.source.worker_id,
        "kvlane.prefix_pull.exposed_tokens": pull.exposed_tokens,
        "kvlane.prefix_pull.pulled_tokens": pull.pulled_tokens,
        "kvlane.prefix_pull.bytes": pull.pulled_bytes,
        "kvlane.prefix_pull.predicted_pull_s": pull.seconds,
        "kvlane.prefix_pull.predicted_recompute_s": pull.recompute_s,
    }


def _annotate_route(span: Span, reply: RouteReply, outcome: str, policy: str) -> None:
    """The route decision on its span: where the request runs, or why it does not."""
    span.set_attributes({"kvlane.route.outcome": outcome, "kvlane.route.policy": policy})
    if isinstance(reply, ErrorReply):
        set_error(span, reply.code, reply.message)
        return
    attributes = {
        "kvlane.worker.id": reply.worker_id,
        "kvlane.route.cached_blocks": reply.cached_blocks,
        "kvlane.route.queue_wait_s": reply.queued_s,
    }
    if reply.prefill_worker_id:
        attributes["kvlane.prefill_worker.id"] = reply.prefill_worker_id
    span.set_attributes(attributes)
