"""Load-only baselines: round-robin, random, least-loaded, power-of-two-choices."""

from __future__ import annotations

import random

from contracts.messages import RouteRequest
from services.balancer.chain_index import Decision
from services.balancer.policies.base import Rotation
from services.balancer.snapshot import ChainState, ClusterSnapshot


class RoundRobin:
    name = "round_robin"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = sorted(snapshot.free(), key=lambda c: c.chain_id)
        if not free:
            return None
        self._turn += 1
        return free[self._turn % len(free)]

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        order = chains.index.chain_order
        free = order[chains.free[order]]
        if not len(free):
            return None
        self._turn += 1
        return int(free[self._turn % len(free)])


class RandomChoice:
    name = "random"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        return self._rng.choice(free) if free else None

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        free = chains.free_rows.tolist()
        return self._rng.choice(free) if free else None


class LeastLoaded:
    """Fewest requests (heartbeat or reservations, whichever is fresher); then least KV used; then in turn."""

    name = "least_loaded"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self) -> None:
        self._rotation = Rotation()

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if not free:
            return None
        return self._rotation.best(free, lambda c: (c.load, c.kv_usage))

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        tied = chains.least("load", "kv_usage")
        return self._rotation.among(tied) if tied else None


class PowerOfTwo:
    """Two chains drawn at random, the less loaded one wins (Mitzenmacher)."""

    name = "power_of_two"
    cache_hold_share = 0.0
    bounds_backlog = False
    fast_forwards = 0

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RouteRequest, snapshot: ClusterSnapshot) -> ChainState | None:
        free = snapshot.free()
        if len(free) < 2:
            return free[0] if free else None
        first, second = self._rng.sample(free, 2)
        return second if second.load < first.load else first

    def choose_indexed(self, request: RouteRequest, chains: Decision) -> int | None:
        free = chains.free_rows.tolist()
        if len(free) < 2:
            return free[0] if free else None
        first, second = self._rng.sample(free, 2)
        load = chains.index.load
        return second if load[second] < load[first] else first
