"""Routing on without a KV lease when Redis or the cache-manager cannot be reached (services/balancer/allocation.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from contracts.cache import Allocation
from contracts.messages import ErrorReply, RouteDecision
from services.balancer.allocation import KvAllocator, Unleased, Unreachable
from shared.bus import BusError, NoResponders, RequestTimeout
from services.balancer.log_throttle import LogThrottle
from tests.unit.balancer_fixtures import heartbeat, request
from tests.unit.test_balancer_core import Clock, make_balancer, route_request

# --- LogThrottle ------------------------------------------------------------------------


@given(
    every_s=st.floats(0.0, 20.0),
    events=st.lists(st.tuples(st.sampled_from("abc"), st.floats(0.0, 5.0)), max_size=200),
)
def test_every_event_is_counted_by_exactly_one_line_and_lines_keep_their_distance(every_s, events) -> None:
    throttle = LogThrottle(every_s)
    now, counted, seen, lines = 0.0, {}, {}, {}
    for kind, gap in events:
        now += gap
        seen[kind] = seen.get(kind, 0) + 1
        count = throttle.due(kind, now)
        if count:
            if kind in lines:
                assert now - lines[kind] >= every_s
            else:
                assert count == 1  # the first event of a kind is logged at once
            lines[kind] = now
            counted[kind] = counted.get(kind, 0) + count
    for kind, total in seen.items():
        # What is not yet logged is held for the next line: nothing is lost or counted twice.
        assert counted[kind] + throttle._held[kind] == total


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="every_s"):
        LogThrottle(-1.0)


# --- Unreachable -------------------------------------------------------------------------


def test_a_failure_stands_for_the_retry_interval_then_one_route_probes_while_the_others_skip() -> None:
    unreachable = Unreachable(1.0)
    failure = Unleased("cache_manager_timeout", "no reply")
    assert unreachable.permit(10.0) == 0
    unreachable.failed(failure, 10.0, 0)
    assert unreachable.permit(10.5) == failure
    probe = unreachable.permit(11.0)
    assert probe == 1
    assert unreachable.permit(11.1) == failure  # while it waits for its answer, the others go on without
    unreachable.failed(failure, 13.0, probe)  # the probe timed out too: another wait
    assert unreachable.permit(13.9) == failure
    assert unreachable.permit(14.0) == 2
    unreachable.answered()
    assert unreachable.permit(14.1) == 0 and unreachable.permit(14.1) == 0  # everyone asks again


def test_a_cancelled_probe_lets_the_next_route_probe_and_only_the_probe_does() -> None:
    unreachable = Unreachable(1.0)
    unreachable.failed(Unleased("cache_manager_unreachable", "no responders"), 0.0, 0)
    probe = unreachable.permit(2.0)
    assert probe == 1
    unreachable.abandoned(0)  # an ask from before the failure, cancelled: the probe still runs
    assert isinstance(unreachable.permit(2.0), Unleased)
    unreachable.abandoned(probe)
    assert unreachable.permit(2.0) == 2


@given(st.lists(st.tuples(st.sampled_from(["ask", "answer", "fail", "abandon"]), st.floats(0.0, 2.0), st.integers(0, 7)),
                max_size=80))
def test_while_the_cache_manager_fails_at_most_one_route_probes_and_none_before_the_retry_time(ops) -> None:
    retry_s = 1.0
    unreachable = Unreachable(retry_s)
    failure = Unleased("cache_manager_timeout", "no reply")
    now, failed_at, asking = 0.0, None, []  # asking: the tickets of the asks in flight
    probing = None  # the probe the breaker lets run now, by the model's reckoning
    for op, gap, pick in ops:
        now += gap
        if op == "ask":
            ticket = unreachable.permit(now)
            if failed_at is None:
                assert ticket == 0
            elif isinstance(ticket, Unleased):
                assert now < failed_at + retry_s or probing is not None
            else:
                assert ticket > 0 and now >= failed_at + retry_s
                assert probing is None, "a second probe while one is in flight"
                probing = ticket
            if not isinstance(ticket, Unleased):
                asking.append(ticket)
        elif asking:
            ticket = asking.pop(pick % len(asking))
            if op == "answer":
                unreachable.answered()
                failed_at, probing = None, None
            else:
                if op == "fail":
                    unreachable.failed(failure, now, ticket)
                    failed_at = now
                else:
                    unreachable.abandoned(ticket)
                if ticket == probing:
                    probing = None


# --- KvAllocator ----------------------------------------------------------------------------


class ScriptedBus:
    """Answers cache-manager requests from a script: an exception to raise or a reply to return."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.requests = 0

    async def request(self, subject, message, reply_type, timeout):
        self.requests += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def publish(self, subject, message, traced=True) -> None:
        pass


CHAIN = SimpleNamespace(worker_id="a", cached_blocks=0, node=SimpleNamespace(worker_id="a", block_size=16, kv_blocks_total=100))
GRANTED = Allocation("r1", "a", 2, 0, "general", 0.0)


@pytest.mark.parametrize(("failure", "reason"), [
    (NoResponders("kvlane.v1.cache.request"), "cache_manager_unreachable"),
    (RequestTimeout("no reply within 2.0s"), "cache_manager_timeout"),
    (BusError("undecodable reply"), "cache_manager_bad_reply"),
])
async def test_a_cache_manager_out_of_reach_gives_an_unleased_route_and_is_left_alone_for_a_while(failure, reason) -> None:
    clock = Clock(100.0)
    bus = ScriptedBus(failure, GRANTED)
    allocator = KvAllocator(bus, 2.0, ledger=None, retry_after_s=1.0, clock=clock)  # type: ignore[arg-type]
    first = await allocator.allocate(request("r1"), CHAIN)  # type: ignore[arg-type]
    assert isinstance(first, Unleased) and first.reason == reason
    clock.value = 100.9
    assert await allocator.allocate(request("r2"), CHAIN) == first  # type: ignore[arg-type]
    assert bus.requests == 1  # not asked while the failure stands
    clock.value = 101.0
    assert await allocator.allocate(request("r3"), CHAIN) == GRANTED  # type: ignore[arg-type]
    assert bus.requests == 2


async def test_a_cache_manager_without_redis_and_a_ledger_without_redis_are_both_redis_outages() -> None:
    bus = ScriptedBus(ErrorReply(code="state_unavailable", message="Redis unavailable", status=503))
    allocator = KvAllocator(bus, 2.0, ledger=None)  # type: ignore[arg-type]
    reply = await allocator.allocate(request("r1"), CHAIN)  # type: ignore[arg-type]
    assert isinstance(reply, Unleased) and reply.reason == "redis_unavailable"

    class DownLedger:
        lease_ttl_s = 10.0

        async def reserve_asked(self, *args):
            raise ConnectionError("Connection refused")

    allocator = KvAllocator(ScriptedBus(), 2.0, ledger=DownLedger())  # type: ignore[arg-type]
    reply = await allocator.allocate(request("r1"), CHAIN)  # type: ignore[arg-type]
    assert reply == Unleased("redis_unavailable", "Connection refused")


async def test_a_refusal_from_the_cache_manager_is_passed_on_not_taken_for_an_outage() -> None:
    refusal = ErrorReply(code="no_capacity", message="no room", status=503)
    allocator = KvAllocator(ScriptedBus(refusal), 2.0, ledger=None)  # type: ignore[arg-type]
    assert await allocator.allocate(request("r1"), CHAIN) == refusal  # type: ignore[arg-type]


# --- BalancerService ------------------------------------------------------------------------


class FixedAllocator:
    def __init__(self, answer) -> None:
        self.answer = answer

    async def allocate(self, request, chain, reserved=None):
        return self.answer

    async def close(self) -> None:
        pass


def unleased_count(balancer, reason: str) -> float:
    return balancer._metrics.registry.get_sample_value("kvlane_balancer_unleased_routes_total", {"reason": reason})


async def test_an_unleased_route_is_placed_and_counted_by_reason() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"))
    balancer._allocator = FixedAllocator(Unleased("cache_manager_unreachable", "no cache-manager is running"))
    for index in range(3):
        assert isinstance(await balancer.route(route_request(f"r{index}")), RouteDecision)
    assert unleased_count(balancer, "cache_manager_unreachable") == 3
    assert unleased_count(balancer, "redis_unavailable") == 0


async def test_no_room_from_the_cache_manager_is_not_routed_there() -> None:
    balancer, _, _ = make_balancer(heartbeat("a"), max_wait_s=0.0)
    balancer._allocator = FixedAllocator(ErrorReply(code="no_capacity", message="no room", status=503))
    reply = await balancer.route(route_request("r1"))
    assert isinstance(reply, ErrorReply)
    assert unleased_count(balancer, "cache_manager_unreachable") == 0
