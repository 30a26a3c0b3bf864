"""/ready's dependencies: a required one that is silent makes the ingress not ready, one that is not only degrades it."""

from __future__ import annotations

from services.ingress.readiness import Dependency, Readiness
from shared.bus import NoResponders, RequestTimeout


class Bus:
    def __init__(self, silent: set[str]) -> None:
        self.silent = silent
        self.pings = 0

    async def request(self, subject, message, reply_type, timeout):
        self.pings += 1
        if subject in self.silent:
            raise NoResponders(subject) if subject == "cache" else RequestTimeout(subject)
        return object()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


DEPENDENCIES = [Dependency("balancer", "route", None, object), Dependency("cache-manager", "cache", None, object, required=False)]


async def test_a_silent_cache_manager_degrades_and_a_silent_balancer_is_missing() -> None:
    bus, clock = Bus({"cache"}), Clock()
    readiness = Readiness(bus, DEPENDENCIES, cache_s=1.0, clock=clock)  # type: ignore[arg-type]
    assert await readiness.missing() == [] and await readiness.degraded() == ["cache-manager"]
    bus.silent = {"route"}
    assert await readiness.missing() == []  # within cache_s: the last answer stands, without pinging again
    assert bus.pings == 2
    clock.now = 1.0
    assert await readiness.missing() == ["balancer"] and await readiness.degraded() == []



async def test_what_a_caller_adds_to_the_answer_is_not_remembered() -> None:
    readiness = Readiness(Bus({"route"}), DEPENDENCIES, cache_s=1.0, clock=Clock())  # type: ignore[arg-type]
    missing = await readiness.missing()
    missing.append("workers")
    assert await readiness.missing() == ["balancer"]
