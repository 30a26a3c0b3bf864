"""The interface every routing policy implements, and helpers they share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from contracts.messages import RouteRequest
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


class Rotation:
    """Breaks exact ties by taking the tied chains in turn, so a burst spreads out."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, tied: Sequence[ChainState]) -> ChainState:
        self._turn += 1
        return tied[self._turn % len(tied)]

    def best(self, chains: Sequence[ChainState], key: Callable[[ChainState], object]) -> ChainState:
        """The chain with the smallest `key`, ties rotated."""
        keys = [key(c) for c in chains]
        lowest = min(keys)  # type: ignore[type-var]
        tied = [c for c, k in zip(chains, keys) if k == lowest]
        return tied[0] if len(tied) == 1 else self.pick(tied)


def match_ratio(chain: ChainState, snapshot: ClusterSnapshot) -> float:
    """Share of the request's full prompt blocks already cached on the chain."""
    return chain.cached_blocks / snapshot.request_blocks if snapshot.request_blocks else 0.0
