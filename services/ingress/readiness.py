"""Whether the services a request needs besides a worker answer on the bus."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import Struct

from shared.bus import Bus, BusError


class Dependency(Struct, frozen=True):
    name: str
    subject: str
    ping: Any
    reply_type: Any


class Readiness:
    """Pings each dependency at most once per `cache_s`; a reply of any kind counts."""

    def __init__(self, bus: Bus, dependencies: list[Dependency], cache_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._bus = bus
        self._dependencies = dependencies
        self._cache_s = cache_s
        self._clock = clock
        self._checked_at = -float("inf")
        self._missing: list[str] = [d.name for d in dependencies]

    async def missing(self) -> list[str]:
        if self._clock() - self._checked_at < self._cache_s:
            return self._missing
        missing = []
        for dependency in self._dependencies:
            try:
                await self._bus.request(dependency.subject, dependency.ping, dependency.reply_type, timeout=1.0)
            except (BusError, msgspec.DecodeError):
                missing.append(dependency.name)
        self._missing, self._checked_at = missing, self._clock()
        return missing
