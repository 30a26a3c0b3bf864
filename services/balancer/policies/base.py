"""The interface every routing policy implements, and helpers they share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from contracts.messages import RouteRequest
from services.balancer.chain_index import Decision
from services.balancer.snapshot import ChainState, ClusterSnapshot


class RoutingPolicy(Protocol):
    """A routing rule, decided on the chain index's columns or on a snapshot, the same chain either way.

    The router decides on the index (`choose_indexed`) whenever the fleet's
    heartbeat list can be indexed, and on a snapshot (`choose`) otherwise:
    a list with decode nodes (a two-node chain is costed per request, with
    its prefill node), or a decision whose figures hold a NaN. The other
    attributes tell the router what else it does for the policy.
    """

    name: str
    # Share of the prompt by which a busy chain must cache more than any free one for a request to wait for it
    # (`Router.holds_for_cache`); 0.0: never.
    cache_hold_share: float
    # Whether the router offers only free chains whose prefill backlog is within `Router.backlog_bound_s`.
    bounds_backlog: bool
    # Requests sent so far to the node caching their prefix rather than to the best-scored one.
    fast_forwards: int

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        """The chain that should run `request`, or None when no chain suits it now.

        Called for every placement attempt: when a request arrives, and again
        for a queued request whenever a slot frees. Must return a chain of
        `snapshot.chains` with a free slot; None makes the request wait in
        the central queue. Must not keep references to the snapshot.
        """
        ...

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        """The row of the chain `choose` would return on the same state (same choice, same tie turns), or None.

        When a figure it asks `chains` for is NaN (`chains.settled` turns
        False), it returns None having changed nothing, not even a tie turn:
        the router then asks `choose`.
        """
        ...


class Rotation:
    """Breaks exact ties by taking the tied chains in turn, so a burst spreads out."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, tied: Sequence[ChainState]) -> ChainState:
        self._turn += 1
        return tied[self._turn % len(tied)]

    def among(self, tied: Sequence[int]) -> int:
        """One of the tied rows, as `best` takes one of tied chains."""
        return tied[0] if len(tied) == 1 else self.pick(tied)  # type: ignore[return-value]

    def best(self, chains: Sequence[ChainState], key: Callable[[ChainState], object]) -> ChainState:
        """The chain with the smallest `key`, ties rotated."""
        keys = [key(c) for c in chains]
        lowest = min(keys)  # type: ignore[type-var]
        tied = [c for c, k in zip(chains, keys) if k == lowest]
        return tied[0] if len(tied) == 1 else self.pick(tied)


def match_ratio(chain: ChainState, snapshot: ClusterSnapshot) -> float:
    """Share of the request's full prompt blocks already cached on the chain."""
    return chain.cached_blocks / snapshot.request_blocks if snapshot.request_blocks else 0.0
