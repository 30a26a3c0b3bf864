"""Wire messages of the cache-manager (`kvlane.v1.cache.*`, msgpack).

Capacity is counted in KV blocks of the node's own block size. An
allocation is a lease: it lives until released or until it expires, and
whoever runs the request renews it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from contracts.messages import Compact, ErrorReply, NonNegativeInt, RemainingSeconds, RequestId, WorkerId

Pool = Literal["short", "general"]


class AllocateRequest(Compact, tag="allocate", tag_field="type"):
    """Reserve KV blocks for a request.

    With `worker_id` set the allocation is made on that node only (the
    balancer's choice); with `candidates` it is made on the best of them;
    with neither, on the best live node serving `model`.
    """

    request_id: RequestId
    model: str
    prompt_tokens: NonNegativeInt
    max_tokens: Annotated[int, Meta(ge=1)]
    block_hashes: list[int] = []
    priority: Annotated[float, Meta(gt=0)] = 1.0
    worker_id: WorkerId | None = None
    candidates: list[WorkerId] = []
    # Allow evicting a lower-value running request when no node has room.
    may_preempt: bool = True
    # The prompt's first tokens (up to the pre-warm prefix length): what a
    # pre-warm prefill replays on another node when this prefix turns hot.
    prefix_token_ids: list[int] = []


class Allocation(Compact, tag="allocation", tag_field="type"):
    request_id: RequestId
    worker_id: WorkerId
    blocks: NonNegativeInt
    cached_blocks: NonNegativeInt
    pool: Pool
    # How long the lease lasts unless renewed, from when the reply was sent (a moment would carry the sender's clock).
    lease_ttl_s: RemainingSeconds
    # Requests preempted to make room (their workers were told to stop them).
    preempted: list[RequestId] = []


AllocateReply = Allocation | ErrorReply


class RoutedPrefix(Struct, array_like=True, gc=False):
    model: str
    block_hashes: list[int]
    prefix_token_ids: list[int]


class PrefixesRouted(Struct, tag="prefixes_routed", tag_field="type"):
    """Prompts a balancer placed with KV leases it took from the ledger itself (one batch per burst).

    Those never reach the cache-manager as an `AllocateRequest`, so this is
    how it still counts their prefixes for pre-warming.
    """

    prefixes: list[RoutedPrefix]


class ReleaseRequest(Compact, tag="release", tag_field="type"):
    request_id: RequestId


class Released(Compact, tag="released", tag_field="type"):
    request_id: RequestId
    blocks: NonNegativeInt
    existed: bool


class LeaseProgress(Struct, array_like=True):
    request_id: RequestId
    generated_tokens: NonNegativeInt


class RenewLeases(Struct, tag="renew", tag_field="type"):
    """A worker's periodic "these requests are still running" (no reply)."""

    worker_id: WorkerId
    leases: list[LeaseProgress]


class LookupRequest(Compact, tag="lookup", tag_field="type"):
    block_hashes: list[int]


class LookupReply(Compact, tag="lookup_reply", tag_field="type"):
    # Per node, the number of leading blocks of the query it holds.
    matches: dict[str, int]


class CacheStatusRequest(Compact, tag="status", tag_field="type"):
    pass


class NodeUsage(Struct):
    worker_id: WorkerId
    blocks_total: NonNegativeInt
    short_pool: NonNegativeInt
    used_general: NonNegativeInt
    used_short: NonNegativeInt
    leases: NonNegativeInt
    indexed_blocks: NonNegativeInt


class CacheStatus(Compact, tag="cache_status", tag_field="type"):
    nodes: list[NodeUsage]
    indexed_blocks: NonNegativeInt
    prewarms: NonNegativeInt
    preemptions: NonNegativeInt


CacheRequest = AllocateRequest | ReleaseRequest | LookupRequest | CacheStatusRequest
CacheReply = Allocation | Released | LookupReply | CacheStatus | ErrorReply

