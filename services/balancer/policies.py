"""Routing policies: pure functions of a request and the candidate nodes.

Every policy implements `RoutingPolicy`, so the service, the tests and the
benchmarks can swap one for another by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from msgspec import Struct

from contracts.messages import RouteRequest


class Candidate(Struct, frozen=True):
    """A node that could take the request, with the load the balancer sees."""

    worker_id: str
    inbox: str
    running: int
    waiting: int
    # Requests this balancer routed there that have not finished yet: fresher
    # than the last heartbeat, so a burst does not pile onto one node.
    outstanding: int
    kv_usage: float

    @property
    def load(self) -> int:
        return max(self.running + self.waiting, self.outstanding)


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        """The node for `request`, or None to refuse; `candidates` is never empty."""


class LeastLoaded:
    """Fewest running + waiting requests; ties go round the tied nodes in turn."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        best_load = min(c.load for c in candidates)
        tied = [c for c in candidates if c.load == best_load]
        least_kv = min(c.kv_usage for c in tied)
        tied = [c for c in tied if c.kv_usage == least_kv]
        self._turn += 1
        return tied[self._turn % len(tied)]


def make_policy(name: str) -> RoutingPolicy:
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown routing policy {name!r} (known: least_loaded)")
