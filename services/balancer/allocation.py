"""A chosen chain's KV blocks: straight from the ledger, or from the cache-manager's preemption.

A route decision stands only with an allocation: the slot says the chain
may run one more request, the lease says its KV memory holds this one.
The balancer owns its requests' leases: it takes them and frees them with
their slots (the Redis slot store in its own scripts, the local one
through `release_many`). The cache-manager preempts when a node has no
room, and reaps the leases nobody freed.

The node is chosen already, so there is nothing to rank: the balancer asks
the shared Redis ledger for the blocks itself (one round trip, the ledger's
script checks room and picks the pool; with the Redis slot store, in the same
script and round trip as the slot: `lease_call`), and only when the node has no room
asks the cache-manager, which may preempt a lower-priority request to make
some. The prefixes of what it placed itself go to the cache-manager a batch
at a time, for pre-warming.

When Redis or the cache-manager cannot be reached, the route goes on
without a lease (`Unleased`, with the reason), as slots do while Redis is
down: availability wins, and the engine's own KV admission still bounds
the node. A cache-manager that failed to answer is not asked again for
`retry_after_s`, and then by one route at a time until it answers, so
routes do not each wait out the timeout of a hung one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec
import structlog
from opentelemetry import trace
from opentelemetry.trace import Tracer
from redis.exceptions import RedisError

from contracts import subjects
from contracts.cache import AllocateReply, AllocateRequest, Allocation, PrefixesRouted, RoutedPrefix
from contracts.messages import ErrorReply, RouteRequest
from services.balancer.snapshot import ChainState
from shared.kv.block_ledger import BlockLedger, Reservation
from shared.bus import Bus, BusError, NoResponders, RequestTimeout
from shared.coalescer import Coalescer
from shared.config import CacheManagerSettings
from shared.kv.allocation import Demand, NodeAsk, ask_on_node
from shared.spans import annotate_allocation

log = structlog.get_logger("kvlane.balancer")

# How long a cache-manager that failed to answer is left alone before it is asked again.
CACHE_MANAGER_RETRY_S = 1.0

UnleasedReason = Literal["redis_unavailable", "cache_manager_unreachable", "cache_manager_timeout", "cache_manager_bad_reply"]


class Unleased(msgspec.Struct, frozen=True):
    """The route goes on without a KV lease: what holds the leases could not be reached."""

    reason: UnleasedReason
    detail: str


class LeaseCall(msgspec.Struct, frozen=True):
    """A planned ledger allocation: the plan, and the (KEYS, ARGV) of the ledger's allocation function."""

    ask: NodeAsk
    keys: list
    args: list


class Unreachable:
    """Whether to ask the cache-manager now, after it failed to answer (pure): a circuit breaker.

    After a failure nobody asks for `retry_after_s`; then one route asks
    (the probe) while the others still go on without, until the probe gets
    an answer (all ask again) or fails too (another wait). Each ask holds a
    ticket: 0 for a plain one, the probe's number for a probe, so an ask
    from before (one that outlived the failure) never ends the probe's turn.
    """

    def __init__(self, retry_after_s: float) -> None:
        self._retry_after_s = retry_after_s
        self._until = -math.inf
        self._failure: Unleased | None = None
        self._probes = 0
        self._probe: int | None = None  # the probe in flight

    def permit(self, now: float) -> Unleased | int:
        """The failure that still stands for this route, or its ticket to ask (> 0: as the probe)."""
        if self._failure is None:
            return 0
        if now < self._until or self._probe is not None:
            return self._failure
        self._probes += 1
        self._probe = self._probes
        return self._probe

    def failed(self, failure: Unleased, now: float, ticket: int) -> None:
        self._until = now + self._retry_after_s
        self._failure = failure
        self.abandoned(ticket)

    def answered(self) -> None:
        self._until = -math.inf
        self._failure = None
        self._probe = None

    def abandoned(self, ticket: int) -> None:
        """The ask with `ticket` ended without an answer (failed, or its route was cancelled): if it was the probe,
        the next route may probe once the wait is over."""
        if ticket == self._probe:
            self._probe = None


class KvAllocator:
    def __init__(self, bus: Bus, timeout_s: float, ledger: BlockLedger | None = None,
                 cache_settings: CacheManagerSettings | None = None, tracer: Tracer | None = None,
                 retry_after_s: float = CACHE_MANAGER_RETRY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._bus = bus
        self._clock = clock
        self._unreachable = Unreachable(retry_after_s)
        self._tracer = tracer or trace.NoOpTracer()
        self._tracing = not isinstance(self._tracer, trace.NoOpTracer)
        self._timeout_s = timeout_s
        self._ledger = ledger
        self._cache_settings = cache_settings or CacheManagerSettings()
        self._routed: Coalescer[RoutedPrefix] = Coalescer("routed-prefixes", self._report_routed)

    def lease_call(self, request: RouteRequest, chain: ChainState) -> LeaseCall | None:
        """What to ask the ledger for on the chosen node, to run with the slot's reservation; None without a ledger."""
        if self._ledger is None:
            return None
        demand = demand_of(request)
        ask = ask_on_node(demand, chain.node.kv_blocks_total, chain.node.block_size, chain.cached_blocks, self._cache_settings)
        keys, args = self._ledger.asked_call(request.request_id, chain.node.worker_id, ask, demand.priority, request.max_tokens)
        return LeaseCall(ask, keys, args)

    async def allocate(self, request: RouteRequest, chain: ChainState,
                       reserved: tuple[LeaseCall, Reservation] | None = None) -> Allocation | ErrorReply | Unleased:
        """The request's lease on the chosen node, in a `kv.allocate` span (child of the request's `route`).

        `reserved`: the ledger's answer to `lease_call`, given with the slot: when granted nothing is left to
        ask; when refused (no room on the node) only the cache-manager may still make some."""
        if not self._tracing:  # a span costs several µs even when nothing records it: one per route decision
            return (await self._allocate(request, chain, reserved))[0]
        with self._tracer.start_as_current_span("kv.allocate", attributes={
            "kvlane.request_id": request.request_id, "kvlane.worker.id": chain.worker_id,
        }) as span:
            allocation, source = await self._allocate(request, chain, reserved)
            if not span.is_recording():
                pass
            elif isinstance(allocation, Unleased):
                span.set_attributes({"kvlane.kv.source": source, "kvlane.kv.unleased": allocation.reason})
            else:
                annotate_allocation(span, allocation, source, chain.node.block_size,
                                    self._ledger.lease_ttl_s if self._ledger is not None else None)
            return allocation

    async def _allocate(self, request: RouteRequest, chain: ChainState, reserved: tuple[LeaseCall, Reservation] | None,
                        ) -> tuple[Allocation | ErrorReply | Unleased, str]:
        """The allocation and where it came from (the ledger or the cache-manager)."""
        allocation = None
        if reserved is not None and self._ledger is not None:
            call, reservation = reserved
            if reservation.granted:
                allocation = self._from_reservation(self._ledger, request, chain, call.ask, reservation)
            source = "ledger"
        elif self._ledger is not None:
            allocation = await self._from_ledger(self._ledger, request, chain)
            source = "ledger"
        if allocation is None:
            return await self._from_cache_manager(request, chain.worker_id), "cache-manager"
        return allocation, source

    async def close(self) -> None:
        await self._routed.close()

    async def release_many(self, releases: Sequence[tuple[str, str]]) -> None:
        """Free the leases of (request_id, worker_id) pairs, in one round trip: the release of a store that keeps
        slots apart from the ledger (`LocalSlotStore`). A lease the ledger cannot free now expires and is reaped."""
        if self._ledger is None:
            return
        try:
            await self._ledger.release_many(releases)
        except (RedisError, OSError) as exc:
            log.warning("lease_release_failed", requests=len(releases), error=str(exc))

    async def _from_ledger(self, ledger: BlockLedger, request: RouteRequest, chain: ChainState) -> Allocation | Unleased | None:
        """The lease, or None when the node has no room for it."""
        node = chain.node
        demand = demand_of(request)
        ask = ask_on_node(demand, node.kv_blocks_total, node.block_size, chain.cached_blocks, self._cache_settings)
        try:
            reservation = await ledger.reserve_asked(request.request_id, node.worker_id, ask, demand.priority, request.max_tokens)
        except (RedisError, OSError) as exc:
            return Unleased("redis_unavailable", str(exc))
        if not reservation.granted:
            return None
        return self._from_reservation(ledger, request, chain, ask, reservation)

    def _from_reservation(self, ledger: BlockLedger, request: RouteRequest, chain: ChainState, ask: NodeAsk,
                          reservation: Reservation) -> Allocation:
        if request.prefix_token_ids and request.block_hashes:
            self._routed.put(RoutedPrefix(request.model, request.block_hashes, request.prefix_token_ids))
        return Allocation(request.request_id, chain.node.worker_id, reservation.blocks, ask.cached_blocks,
                          reservation.pool, ledger.lease_ttl_s)  # type: ignore[arg-type]

    async def _from_cache_manager(self, request: RouteRequest, worker_id: str) -> Allocation | ErrorReply | Unleased:
        ticket = self._unreachable.permit(self._clock())
        if isinstance(ticket, Unleased):
            return ticket
        ask = AllocateRequest(
            request_id=request.request_id,
            model=request.model,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            block_hashes=request.block_hashes,
            priority=demand_of(request).priority,
            worker_id=worker_id,
            prefix_token_ids=request.prefix_token_ids,
        )
        try:
            reply = await self._bus.request(subjects.CACHE_REQUEST, ask, AllocateReply, self._timeout_s)
        except NoResponders:
            return self._failed(Unleased("cache_manager_unreachable", "no cache-manager is running"), ticket)
        except RequestTimeout as exc:
            return self._failed(Unleased("cache_manager_timeout", str(exc)), ticket)
        except BusError as exc:
            return self._failed(Unleased("cache_manager_bad_reply", str(exc)), ticket)
        except BaseException:
            self._unreachable.abandoned(ticket)
            raise
        self._unreachable.answered()
        if isinstance(reply, ErrorReply) and reply.code == "state_unavailable":
            return Unleased("redis_unavailable", reply.message)  # the cache-manager's Redis is down
        return reply

    def _failed(self, failure: Unleased, ticket: int) -> Unleased:
        self._unreachable.failed(failure, self._clock(), ticket)
        return failure

    async def _report_routed(self, prefixes: list[RoutedPrefix]) -> None:
        try:
            await self._bus.publish(subjects.CACHE_ROUTED, PrefixesRouted(prefixes), traced=False)
        except Exception as exc:  # pre-warming misses one burst; routing goes on
            log.warning("routed_prefixes_lost", prefixes=len(prefixes), error=str(exc))


def demand_of(request: RouteRequest) -> Demand:
    """What a route request asks of the allocation core."""
    # Priority classes 0, 1, 2... weigh 1, 2, 3... in the greedy utility.
    return Demand(request.request_id, request.prompt_tokens, request.max_tokens, 1.0 + max(0, request.priority))

