"""Asking the cache-manager for a chosen chain's KV blocks.

A route decision stands only with an allocation: the slot says the chain
may run one more request, the lease says its KV memory holds this one.
"""

from __future__ import annotations

from contracts import subjects
from contracts.cache import AllocateReply, AllocateRequest, Allocation
from contracts.messages import ErrorReply, RouteRequest
from shared.bus import Bus, BusError, NoResponders


class KvAllocator:
    def __init__(self, bus: Bus, timeout_s: float) -> None:
        self._bus = bus
        self._timeout_s = timeout_s

    async def allocate(self, request: RouteRequest, worker_id: str) -> Allocation | ErrorReply:
        ask = AllocateRequest(
            request_id=request.request_id,
            model=request.model,
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            block_hashes=request.block_hashes,
            # Priority classes 0, 1, 2... weigh 1, 2, 3... in the greedy utility.
            priority=1.0 + max(0, request.priority),
            worker_id=worker_id,
            prefix_token_ids=request.prefix_token_ids,
        )
        try:
            return await self._bus.request(subjects.CACHE_REQUEST, ask, AllocateReply, self._timeout_s)
        except NoResponders:
            return ErrorReply(code="cache_manager_unavailable", message="no cache-manager is running", status=503, retry_after_s=1.0)
        except BusError as exc:
            return ErrorReply(code="cache_manager_unavailable", message=f"allocation failed: {exc}", status=503, retry_after_s=1.0)
