"""A chosen chain's KV blocks: straight from the ledger, or from the cache-manager.

A route decision stands only with an allocation: the slot says the chain
may run one more request, the lease says its KV memory holds this one.

The node is chosen already, so there is nothing to rank: the balancer asks
the shared Redis ledger for the blocks itself (one round trip, the ledger's
script checks room and picks the pool), and only when the node has no room
asks the cache-manager, which may preempt a lower-priority request to make
some. The prefixes of what it placed itself go to the cache-manager a batch
at a time, for pre-warming.
"""

from __future__ import annotations

import time

import structlog
from opentelemetry import trace
from opentelemetry.trace import Tracer
from redis.exceptions import RedisError

from contracts import subjects
from contracts.cache import AllocateReply, AllocateRequest, Allocation, PrefixesRouted, RoutedPrefix
from contracts.messages import ErrorReply, RouteRequest
from services.balancer.snapshot import ChainState
from shared.block_ledger import BlockLedger
from shared.bus import Bus, BusError, NoResponders
from shared.coalescer import Coalescer
from shared.config import CacheManagerSettings
from shared.kv_allocation import Demand, ask_on_node
from shared.spans import annotate_allocation

log = structlog.get_logger("kvlane.balancer")


class KvAllocator:
    def __init__(self, bus: Bus, timeout_s: float, ledger: BlockLedger | None = None,
                 cache_settings: CacheManagerSettings | None = None, tracer: Tracer | None = None) -> None:
        self._bus = bus
        self._tracer = tracer or trace.NoOpTracer()
        self._timeout_s = timeout_s
        self._ledger = ledger
        self._cache_settings = cache_settings or CacheManagerSettings()
        self._routed: Coalescer[RoutedPrefix] = Coalescer("routed-prefixes", self._report_routed)

    async def allocate(self, request: RouteRequest, chain: ChainState) -> Allocation | ErrorReply:
        """The request's lease on the chosen node, in a `kv.allocate` span (child of the request's `route`)."""
        with self._tracer.start_as_current_span("kv.allocate", attributes={
            "kvlane.request_id": request.request_id, "kvlane.worker.id": chain.worker_id,
        }) as span:
            allocation = None
            if self._ledger is not None:
                allocation = await self._from_ledger(self._ledger, request, chain)
                source = "ledger"
            if allocation is None:
                allocation = await self._from_cache_manager(request, chain.worker_id)
                source = "cache-manager"
            if span.is_recording():
                annotate_allocation(span, allocation, source, chain.node.block_size,
                                    self._ledger.lease_ttl_s if self._ledger is not None else None)
            return allocation

    async def close(self) -> None:
        await self._routed.close()

    async def _from_ledger(self, ledger: BlockLedger, request: RouteRequest, chain: ChainState) -> Allocation | ErrorReply | None:
        """The lease, or None when the node has no room for it."""
        node = chain.node
        demand = demand_of(request)
        ask = ask_on_node(demand, node.kv_blocks_total, node.block_size, chain.cached_blocks, self._cache_settings)
        try:
            reservation = await ledger.reserve_asked(request.request_id, node.worker_id, ask, demand.priority, request.max_tokens)
        except (RedisError, OSError) as exc:
            return ErrorReply(code="state_unavailable", message=f"Redis unavailable: {exc}", status=503, retry_after_s=1.0)
        if not reservation.granted:
            return None
        if request.prefix_token_ids and request.block_hashes:
            self._routed.put(RoutedPrefix(request.model, request.block_hashes, request.prefix_token_ids))
        return Allocation(request.request_id, node.worker_id, reservation.blocks, ask.cached_blocks,
                          reservation.pool, time.time() + ledger.lease_ttl_s)  # type: ignore[arg-type]

    async def _from_cache_manager(self, request: RouteRequest, worker_id: str) -> Allocation | ErrorReply:
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
            return await self._bus.request(subjects.CACHE_REQUEST, ask, AllocateReply, self._timeout_s)
        except NoResponders:
            return ErrorReply(code="cache_manager_unavailable", message="no cache-manager is running", status=503, retry_after_s=1.0)
        except BusError as exc:
            return ErrorReply(code="cache_manager_unavailable", message=f"allocation failed: {exc}", status=503, retry_after_s=1.0)

    async def _report_routed(self, prefixes: list[RoutedPrefix]) -> None:
        try:
            await self._bus.publish(subjects.CACHE_ROUTED, PrefixesRouted(prefixes), traced=False)
        except Exception as exc:  # pre-warming misses one burst; routing goes on
            log.warning("routed_prefixes_lost", prefixes=len(prefixes), error=str(exc))


def demand_of(request: RouteRequest) -> Demand:
    """What a route request asks of the allocation core."""
    # Priority classes 0, 1, 2... weigh 1, 2, 3... in the greedy utility.
    return Demand(request.request_id, request.prompt_tokens, request.max_tokens, 1.0 + max(0, request.priority))

