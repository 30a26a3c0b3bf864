"""The interface every routing policy implements, and helpers they share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from contracts.messages import RouteRequest
from services.balancer.chain_index import Decision
from services.balancer.snapshot import ChainState, ClusterSnapshot


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        """The chain that should run `request`, or None when no chain suits it now.

        Called for every placement attempt: when a request arrives, and again
        for a queued request whenever a slot frees. Must return a chain of
        `snapshot.chains` with a free slot; None makes the request wait in
        the central queue. Must not keep references to the snapshot.
        """
        ...


class IndexedPolicy(RoutingPolicy, Protocol):
    """A policy that can also choose from the chain index's columns, without a snapshot."""

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        """The row of the chain `choose` would return on the same state (same choice, same tie turns), or None."""
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
