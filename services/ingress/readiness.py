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
    # Whether requests fail without it; one that is not required only makes them degrade (reported, still ready).
    required: bool = True


class Readiness:
    """Pings each dependency at most once per `cache_s`; a reply of any kind counts."""

    def __init__(self, bus: Bus, dependencies: list[Dependency], cache_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._bus = bus
        self._dependencies = dependencies
        self._cache_s = cache_s
        self._clock = clock
        self._checked_at = -float("inf")
        self._missing: list[str] = [d.name for d in dependencies if d.required]
        self._degraded: list[str] = [d.name for d in dependencies if not d.required]

    async def missing(self) -> list[str]:
        """The required dependencies that do not answer."""
        await self._check()
        return list(self._missing)  # the caller's to extend

    async def degraded(self) -> list[str]:
        """The dependencies that do not answer but are not required."""
        await self._check()
        return list(self._degraded)  # the caller's to extend

    async def _check(self) -> None:
        if self._clock() - self._checked_at < self._cache_s:
            return
        silent = []
        for dependency in self._dependencies:
            try:
                await self._bus.request(dependency.subject, dependency.ping, dependency.reply_type, timeout=1.0)
            except (BusError, msgspec.DecodeError):
                silent.append(dependency)
        self._missing = [d.name for d in silent if d.required]
        self._degraded = [d.name for d in silent if not d.required]
        self._checked_at = self._clock()
