"""The cache-manager: the cluster's view of KV memory, wired to NATS and Redis.

The balancers take their requests' KV leases from the ledger and free them
when the requests end; what is left here is what they cannot do on their
own. On `kvlane.v1.cache.request` (a queue group: replicas share the work
and the Redis ledger) it answers a balancer whose node had no room by
preempting lower-priority requests there, and answers release, lookup,
status and allocations for clients that lease nothing themselves. It
renews leases from workers' `RenewLeases`, reaps the expired ones (a
crashed balancer's, a dead worker's), keeps the prefix index from workers'
`KvEvents`, and pre-warms hot prefixes. A withdrawn route's lease it frees
too: one its preemption granted may land after the balancer's release.

Any number of replicas may run. Requests, renewals and releases go to one
replica each (queue groups) and every change to the ledger is one atomic
script, so replicas never over-commit a node. Every replica reaps expired
leases (reaping twice frees nothing twice); pre-warming, which sends work to
workers, runs only on the replica that holds the `prewarm` leadership lock
in Redis, and every replica hears the routed prefixes, so whichever leads
knows what is hot.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import redis.asyncio as redis
import structlog
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import Tracer
from redis.exceptions import RedisError

from contracts import subjects
from contracts.cache import (
    AllocateRequest,
    Allocation,
    CacheReply,
    CacheRequest,
    CacheStatus,
    CacheStatusRequest,
    LookupReply,
    LookupRequest,
    NodeUsage,
    PrefixesRouted,
    Released,
    ReleaseRequest,
    RenewLeases,
)
from contracts.messages import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    KvEvents,
    RouteWithdrawn,
    SamplingParams,
    WorkerLeft,
)
from services.cache_manager.metrics import CacheMetrics
from services.cache_manager.prewarm import HotPrefixTracker, plan_prewarms
from shared.kv.block_ledger import BlockLedger
from shared.bus import Bus
from shared.cluster import ClusterView
from shared.config import CacheManagerSettings
from shared.kv.allocation import Demand, NodeCapacity, ask_on_node, plan_preemption, rank
from services.cache_manager.leadership import Leadership
from shared.periodic import Periodic
from shared.kv.prefix_index import PrefixIndex
from shared.spans import annotate_allocation

log = structlog.get_logger("kvlane.cache_manager")

_RESERVE_ATTEMPTS = 3
# The pre-warming lock lives this many maintenance intervals: its holder renews it every interval.
_LEADER_TTL_INTERVALS = 3


def maintenance_interval_s(settings: CacheManagerSettings) -> float:
    return min(1.0, settings.lease_ttl_s / 4)


def prewarm_leadership(client: redis.Redis, settings: CacheManagerSettings, manager_id: str) -> Leadership:
    """The lock that makes one replica at a time pre-warm."""
    return Leadership(client, "prewarm", manager_id, maintenance_interval_s(settings) * _LEADER_TTL_INTERVALS)


class CacheManagerService:
    def __init__(
        self,
        settings: CacheManagerSettings,
        bus: Bus,
        view: ClusterView,
        ledger: BlockLedger,
        metrics: CacheMetrics,
        manager_id: str,
        clock: Callable[[], float] = time.monotonic,
        tracer: Tracer | None = None,
        prewarm_leader: Leadership | None = None,
    ) -> None:
        self._settings = settings
        self._tracer = tracer or trace.NoOpTracer()
        self._bus = bus
        self._view = view
        self._ledger = ledger
        self._metrics = metrics
        self._manager_id = manager_id
        self._clock = clock
        self.index = PrefixIndex(settings.index_max_blocks)
        self._nodes_with_events: set[str] = set()
        self._history: deque[tuple[float, str, list[int]]] = deque()
        self._hot = HotPrefixTracker(settings.prewarm_window_s, settings.prewarm_min_hits)
        self._prewarming: dict[tuple[int, str], float] = {}
        self._maintenance = Periodic("cache-maintenance", maintenance_interval_s(settings), self._maintain)
        # None: this replica pre-warms alone.
        self._prewarm_leader = prewarm_leader

    async def start(self) -> None:
        # Before answering anything: a replica that returns after an outage finds the ledger full of the
        # leases nobody released meanwhile, and those that expired must not refuse its first allocations.
        await self._reap_expired()
        queue = subjects.CACHE_QUEUE_GROUP
        await self._bus.subscribe(subjects.CACHE_REQUEST, CacheRequest, self._on_request, queue=queue, concurrent=True)
        await self._bus.subscribe(subjects.CACHE_RENEW, RenewLeases, self._on_renew, queue=queue, traced=False)
        # Every replica keeps its own index and hot prefixes (whichever leads pre-warming uses them), so these are
        # broadcast (no queue).
        await self._bus.subscribe(subjects.CACHE_ROUTED, PrefixesRouted, self._on_routed, traced=False)
        # These only update memory: handled as nats-py reads them, without a task per message.
        await self._bus.subscribe(subjects.KV_EVENTS_ALL, KvEvents, self._on_kv_events, traced=False, at_once=True)
        await self._bus.subscribe(subjects.ROUTE_WITHDRAWN, RouteWithdrawn, self._on_withdrawn, queue=queue)
        await self._bus.subscribe(subjects.WORKER_LEFT, WorkerLeft, self._on_worker_left)
        self._maintenance.start()

    async def stop(self) -> None:
        await self._maintenance.stop()
        if self._prewarm_leader is not None:
            await self._prewarm_leader.resign()

    # --- requests -----------------------------------------------------------------

    async def _on_request(self, request: CacheRequest, msg: Msg) -> CacheReply:
        try:
            match request:
                case AllocateRequest():
                    return await self._traced_allocate(request)
                case ReleaseRequest(request_id=request_id):
                    freed = await self._ledger.release_on_any(request_id, self._live_worker_ids())
                    return Released(request_id, freed or 0, freed is not None)
                case LookupRequest(block_hashes=hashes):
                    return LookupReply(self.index.match(hashes))
                case CacheStatusRequest():
                    return await self.status()
        except (RedisError, OSError) as exc:
            log.warning("redis_unavailable", error=str(exc))
            return ErrorReply(code="state_unavailable", message=f"Redis unavailable: {exc}", status=503, retry_after_s=1.0)
        raise AssertionError(f"unhandled {type(request).__name__}")

    async def _traced_allocate(self, request: AllocateRequest) -> Allocation | ErrorReply:
        """`allocate` in a `kv.allocate` span (child of the balancer's, through the request's headers)."""
        with self._tracer.start_as_current_span("kv.allocate", attributes={
            "kvlane.request_id": request.request_id, "kvlane.kv.may_preempt": request.may_preempt,
        }) as span:
            allocation = await self.allocate(request)
            if span.is_recording():
                block_size = None
                if isinstance(allocation, Allocation):
                    node = next((hb for hb in self._view.live(self._clock()) if hb.registration.worker_id == allocation.worker_id), None)
                    block_size = node.registration.block_size if node is not None else None
                annotate_allocation(span, allocation, "cache-manager", block_size, self._ledger.lease_ttl_s)
            return allocation

    async def allocate(self, request: AllocateRequest) -> Allocation | ErrorReply:
        settings = self._settings
        heartbeats = {hb.registration.worker_id: hb for hb in self._view.routable(self._clock(), request.model)}
        if request.worker_id is not None:
            wanted = [request.worker_id]
        elif request.candidates:
            wanted = list(request.candidates)
        else:
            wanted = sorted(heartbeats)
        unknown = [w for w in wanted if w not in heartbeats]
        if request.worker_id is not None and unknown:
            return ErrorReply(code="unknown_node", message=f"no live node {request.worker_id!r} serves {request.model!r}", status=404)
        wanted = [w for w in wanted if w in heartbeats]
        if not wanted:
            return ErrorReply(code="no_nodes", message=f"no live node serves {request.model!r}", status=503, retry_after_s=1.0)

        demand = Demand(request.request_id, request.prompt_tokens, request.max_tokens, request.priority)
        cached = self.index.match(request.block_hashes)
        self._observe_prefix(request.model, request.block_hashes, request.prefix_token_ids)
        if request.worker_id is not None:
            # A balancer's route whose lease the ledger refused on its node (balancers lease themselves): what is
            # asked is room, by preemption. One try on the ledger first, in one round trip: a lease may have ended
            # meanwhile, and no request need then be preempted.
            granted = await self._reserve_on(request, demand, heartbeats[request.worker_id], cached)
            if granted is not None:
                return granted
        for _ in range(_RESERVE_ATTEMPTS):
            nodes = await self._capacities(wanted, heartbeats)
            plans = rank(demand, nodes, cached, settings)
            if not plans:
                break
            for plan in plans:
                node = next(n for n in nodes if n.worker_id == plan.worker_id)
                reservation = await self._ledger.reserve(
                    request.request_id, plan.worker_id, plan.blocks, plan.pool,
                    node.blocks_total - node.short_pool(settings), node.short_pool(settings),
                    request.priority, request.max_tokens,
                )
                if reservation.granted:
                    return self._granted(request, plan.worker_id, reservation.blocks, plan.cached_blocks, reservation.pool)
            # Every ranked node filled up meanwhile (another replica won): look again.
        if request.may_preempt:
            allocation = await self._allocate_by_preemption(request, demand, wanted, heartbeats, cached)
            if allocation is not None:
                return allocation
        self._metrics.allocations.labels("no_capacity").inc()
        return ErrorReply(code="no_capacity", message="no node has room for this request's KV blocks", status=503, retry_after_s=1.0)

    async def _reserve_on(self, request: AllocateRequest, demand: Demand, heartbeat: Heartbeat,
                          cached: dict[str, int]) -> Allocation | None:
        worker_id = heartbeat.registration.worker_id
        ask = ask_on_node(demand, heartbeat.stats.kv_blocks_total, heartbeat.registration.block_size,
                          cached.get(worker_id, 0), self._settings)
        reservation = await self._ledger.reserve_asked(request.request_id, worker_id, ask, request.priority, request.max_tokens)
        if not reservation.granted:
            return None
        return self._granted(request, worker_id, reservation.blocks, ask.cached_blocks, reservation.pool)

    async def _capacities(self, worker_ids: list[str], heartbeats: dict[str, Heartbeat]) -> list[NodeCapacity]:
        usage = await self._ledger.usage(worker_ids)
        return [
            NodeCapacity(w, heartbeats[w].stats.kv_blocks_total, heartbeats[w].registration.block_size, *usage[w][:2])
            for w in worker_ids
        ]

    def _granted(self, request: AllocateRequest, worker_id: str, blocks: int, cached_blocks: int, pool: str,
                 preempted: list[str] | None = None) -> Allocation:
        self._metrics.allocations.labels("granted").inc()
        if worker_id not in self._nodes_with_events and request.block_hashes:
            # No KV events from this node: approximate its cache by what we sent it.
            self.index.apply(worker_id, stored=request.block_hashes)
            self._history.append((self._clock() + self._settings.history_ttl_s, worker_id, list(request.block_hashes)))
        return Allocation(
            request_id=request.request_id,
            worker_id=worker_id,
            blocks=blocks,
            cached_blocks=cached_blocks,
            pool=pool,  # type: ignore[arg-type]
            lease_ttl_s=self._ledger.lease_ttl_s,
            preempted=preempted or [],
        )

    async def _allocate_by_preemption(
        self, request: AllocateRequest, demand: Demand, wanted: list[str], heartbeats: dict[str, Heartbeat], cached: dict[str, int],
    ) -> Allocation | None:
        settings = self._settings
        nodes = [(node, await self._ledger.leases_on(node.worker_id)) for node in await self._capacities(wanted, heartbeats)]
        plan = plan_preemption(demand, nodes, cached, settings)
        if plan is None:
            return None
        node = next(node for node, _ in nodes if node.worker_id == plan.worker_id)
        # One atomic step: were the victims released first, another replica could take their blocks
        # before the newcomer's reservation, and they would be aborted for nothing.
        preemption = await self._ledger.preempt(
            request.request_id, node.worker_id, plan.blocks, plan.pool, node.blocks_total - node.short_pool(settings),
            node.short_pool(settings), request.priority, request.max_tokens, [v.request_id for v in plan.victims],
        )
        if not preemption.reservation.granted:
            return None
        for victim in preemption.preempted:
            await self._bus.publish(heartbeats[node.worker_id].registration.inbox, AbortRequest(victim, reason="preempted"))
            self._metrics.preempted()
            log.info("preempted", victim=victim, for_request=request.request_id, worker_id=node.worker_id)
        reservation = preemption.reservation
        return self._granted(request, node.worker_id, reservation.blocks, plan.cached_blocks, reservation.pool,
                             preemption.preempted)

    async def status(self) -> CacheStatus:
        live = sorted(hb.registration.worker_id for hb in self._view.live(self._clock()))
        heartbeats = {hb.registration.worker_id: hb for hb in self._view.live(self._clock())}
        usage = await self._ledger.usage(live)
        nodes = [
            NodeUsage(
                worker_id=w,
                blocks_total=heartbeats[w].stats.kv_blocks_total,
                short_pool=int(heartbeats[w].stats.kv_blocks_total * self._settings.short_pool_share),
                used_general=usage[w][0],
                used_short=usage[w][1],
                leases=usage[w][2],
                indexed_blocks=self.index.blocks_on(w),
            )
            for w in live
        ]
        return CacheStatus(nodes, len(self.index), self._metrics.prewarm_count, self._metrics.preemption_count)

    # --- events -------------------------------------------------------------------

    async def _on_renew(self, renew: RenewLeases, msg: Msg) -> None:
        try:
            await self._ledger.renew(renew.worker_id, [(p.request_id, p.generated_tokens) for p in renew.leases])
        except (RedisError, OSError) as exc:
            log.warning("lease_renew_failed", worker_id=renew.worker_id, error=str(exc))

    async def _on_routed(self, routed: PrefixesRouted, msg: Msg) -> None:
        for prefix in routed.prefixes:
            self._observe_prefix(prefix.model, prefix.block_hashes, prefix.prefix_token_ids)

    async def _release_anywhere(self, request_id: str) -> None:
        try:
            # Only the request is known: its lease, if any, is on one of the nodes alive (a lease on a node that
            # left expires and is reaped).
            await self._ledger.release_on_any(request_id, self._live_worker_ids())
        except (RedisError, OSError) as exc:
            # The lease expires by itself; its blocks come back then.
            log.warning("lease_release_failed", request_id=request_id, error=str(exc))

    async def _on_withdrawn(self, event: RouteWithdrawn, msg: Msg) -> None:
        # The balancer that placed the request frees its lease, but a lease a preemption here granted may land
        # after that release.
        await self._release_anywhere(event.request_id)

    def _on_kv_events(self, events: KvEvents, msg: Msg) -> None:
        if events.worker_id not in self._nodes_with_events:
            self._nodes_with_events.add(events.worker_id)
            self.index.remove_node(events.worker_id)  # drop what history approximated
        self.index.apply(events.worker_id, events.stored, events.removed, events.cleared)

    async def _on_worker_left(self, event: WorkerLeft, msg: Msg) -> None:
        self._forget_node(event.worker_id)

    def _forget_node(self, worker_id: str) -> None:
        self.index.remove_node(worker_id)
        self._nodes_with_events.discard(worker_id)

    # --- maintenance: reaping, history expiry, pre-warming ---------------------------

    async def _maintain(self) -> None:
        await self._reap_expired()
        now = self._clock()
        for worker_id in self._view.prune(now):
            self._forget_node(worker_id)
        while self._history and self._history[0][0] <= now:
            _, worker_id, hashes = self._history.popleft()
            if worker_id not in self._nodes_with_events:
                self.index.apply(worker_id, removed=hashes)
        self._metrics.indexed_blocks.set(len(self.index))
        if self._settings.prewarm and (self._prewarm_leader is None or await self._prewarm_leader.leading()):
            await self._prewarm(now)

    async def _reap_expired(self) -> None:
        # On every replica: the reaping script frees each expired lease once, whoever runs it.
        try:
            reaped = await self._ledger.reap(self._live_worker_ids())
            if reaped:
                self._metrics.expired_leases.inc(len(reaped))
                log.info("leases_expired", count=len(reaped), request_ids=reaped[:10])
        except (RedisError, OSError) as exc:
            log.warning("lease_reap_failed", error=str(exc))

    def _live_worker_ids(self) -> list[str]:
        return sorted(hb.registration.worker_id for hb in self._view.live(self._clock()))

    def _observe_prefix(self, model: str, block_hashes: list[int], prefix_token_ids: list[int]) -> None:
        if not self._settings.prewarm or not prefix_token_ids or not block_hashes:
            return
        heartbeats = self._view.routable(self._clock(), model)
        if not heartbeats:
            return
        block_size = heartbeats[0].registration.block_size
        depth = min(len(block_hashes), len(prefix_token_ids) // block_size)
        if depth:
            self._hot.observe(tuple(block_hashes[:depth]), tuple(prefix_token_ids[: depth * block_size]), self._clock())

    async def _prewarm(self, now: float) -> None:
        self._prewarming = {k: t for k, t in self._prewarming.items() if t > now}
        hot = self._hot.hot(now)
        if not hot:
            return
        heartbeats = {hb.registration.worker_id: hb for hb in self._view.live(now) if not hb.draining}
        if not heartbeats:
            return
        try:
            loads = {n.worker_id: n.load for n in await self._capacities(sorted(heartbeats), heartbeats)}
        except (RedisError, OSError):
            return
        matches = {p.key: self.index.match(p.block_hashes) for p in hot}
        for plan in plan_prewarms(hot, matches, loads, self._settings.prewarm_high_load, self._settings.prewarm_low_load,
                                  set(self._prewarming)):
            registration = heartbeats[plan.target].registration
            request_id = f"prewarm-{plan.prefix.key & 0xFFFFFFFFFFFF:x}-{plan.target}"[:64]
            prefill = GenerateRequest(
                request_id=request_id,
                model=registration.model,
                prompt_token_ids=list(plan.prefix.token_ids),
                sampling=SamplingParams(max_tokens=1, temperature=0.0),
                stream_to=subjects.stream_subject(self._manager_id, request_id),
                timeout_s=60.0,
            )
            self._prewarming[(plan.prefix.key, plan.target)] = now + self._settings.prewarm_window_s
            await self._bus.publish(registration.inbox, prefill)
            self._metrics.prewarmed()
            log.info("prewarm", target=plan.target, prefix_blocks=len(plan.prefix.block_hashes), hits=plan.prefix.hits)
