"""Fair share between tenants in the central queue: virtual counters, lifts, order, and the bound VTC proves."""

from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st

from contracts.messages import ErrorReply, Heartbeat, RouteRequest
from services.balancer.central_queue import CentralQueue
from services.balancer.fair_share import SharedCounters, TenantShares
from services.balancer.router import Placement, Queued, Router
from shared.config import QueueSettings
from tests.unit.balancer_fixtures import NOW_WALL, heartbeat, router

MAX_PROMPT, MAX_OUTPUT = 512, 256
_ids = itertools.count()


def request(tenant: str, prompt: int = 100, max_tokens: int = 50, weight: float = 1.0, priority: int = 0) -> RouteRequest:
    return RouteRequest(request_id=f"r{next(_ids)}", model="m", prompt_tokens=prompt, max_tokens=max_tokens, timeout_s=30.0,
                        tenant=tenant, tenant_weight=weight, priority=priority)


def test_the_least_served_tenant_goes_first_and_the_oldest_of_its_requests() -> None:
    shares = TenantShares(prompt_cost=1.0, output_cost=2.0)
    queue = CentralQueue(100)
    for _ in range(10):
        queue.push(request("a"), 0.0, 30.0)
    late = request("b")
    queue.push(late, 1.0, 30.0)
    shares.placed(request("a"))  # a has been served, b not
    order = [e.request for e in queue.in_order(shares)]
    assert order[0] is late
    assert [r.request_id for r in order[1:]] == sorted((r.request_id for r in order[1:]), key=lambda i: int(i[1:]))


def test_tenants_of_equal_counters_alternate_by_their_charges() -> None:
    shares = TenantShares()
    queue = CentralQueue(100)
    for _ in range(4):
        queue.push(request("a"), 0.0, 30.0)
    for _ in range(4):
        queue.push(request("b"), 0.0, 30.0)
    assert [e.request.tenant for e in queue.in_order(shares)] == ["a", "b"] * 4


def test_a_weight_of_two_is_served_twice_as_often() -> None:
    shares = TenantShares()
    queue = CentralQueue(100)
    for _ in range(6):
        queue.push(request("heavy", weight=2.0), 0.0, 30.0)
        queue.push(request("light"), 0.0, 30.0)
    first_six = [e.request.tenant for e in queue.in_order(shares)][:6]
    assert first_six.count("heavy") == 4 and first_six.count("light") == 2


def test_a_tenant_idle_while_another_was_served_banks_no_credit() -> None:
    shares = TenantShares()
    for _ in range(50):
        shares.placed(request("a"))
    shares.arrived("b", {"a": 3})
    assert shares.counter("b") == shares.counter("a")
    # With nothing waiting it is lifted to the running tenants' lowest counter, and with nothing active to the highest.
    shares.arrived("c", {})
    assert shares.counter("c") == shares.counter("a")


def test_a_tenant_with_requests_waiting_is_not_lifted() -> None:
    shares = TenantShares()
    for _ in range(5):
        shares.placed(request("a"))
    shares.arrived("b", {"a": 1, "b": 2})
    assert shares.counter("b") == 0.0


def test_the_end_settles_the_charge_with_the_output_given() -> None:
    shares = TenantShares(prompt_cost=1.0, output_cost=2.0)
    placed = request("a", prompt=100, max_tokens=50)
    charge = shares.placed(placed)
    assert charge is not None and charge.service == 100 + 2 * 50  # no output measured yet: max_tokens expected
    settled = shares.finished(placed.request_id, 10)
    assert settled is not None and settled.service == 2 * (10 - 50)
    assert shares.counter("a") == 100 + 2 * 10
    # The fleet's mean output is expected from then on, at most max_tokens.
    assert shares.charge_of(request("a", prompt=0, max_tokens=50)) == 2 * 10
    assert shares.finished(placed.request_id, 10) is None  # once


def test_a_request_placed_again_is_charged_once() -> None:
    shares = TenantShares()
    again = request("a")
    assert shares.placed(again) is not None
    assert shares.placed(again) is None


def test_shared_counters_replace_what_a_replica_knew() -> None:
    shares = TenantShares()
    shares.placed(request("a", prompt=100, max_tokens=1))
    shares.read(SharedCounters(service={"a": 500.0, "b": 40.0}, lift={"b": 10.0}))
    assert shares.counter("a") == 500.0 and shares.counter("b") == 50.0
    shares.placed(request("b", prompt=10, max_tokens=1))
    assert shares.counter("b") == 62.0
    shares.read(SharedCounters(service={"b": 52.0}, lift={"b": 5.0}))  # a lower lift read back never lowers one
    assert shares.counter("b") == 62.0


def test_idle_tenants_at_or_below_the_active_ones_are_forgotten() -> None:
    shares = TenantShares()
    shares.placed(request("gone"))
    shares.finished(next(iter(shares._running)), 50)
    for _ in range(3):
        shares.placed(request("busy"))
    shares.forget_idle({"busy": 1})
    assert "gone" not in shares.counters() and "busy" in shares.counters()


def test_the_queue_predicts_a_wait_of_tenants_in_turn() -> None:
    queue = CentralQueue(100)
    for _ in range(10):
        queue.push(request("a"), 0.0, 30.0)
    queue.push(request("b"), 0.0, 30.0)
    queue.push(request("c", priority=1), 0.0, 30.0)
    assert queue.ahead_of(0) == 12  # arrival order: everything
    assert queue.ahead_of(0, "b") == 1 + 2 + 1  # the higher class, then one of a's and b's own each turn
    assert queue.ahead_of(0, "new") == 1 + 1 + 1


@settings(max_examples=100, deadline=None)
@given(
    tenants=st.lists(st.tuples(st.sampled_from([0.5, 1.0, 2.0, 3.0])), min_size=2, max_size=4),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, MAX_PROMPT), st.integers(1, MAX_OUTPUT),
                             st.integers(0, MAX_OUTPUT), st.booleans()), min_size=100, max_size=400),
    slots=st.integers(1, 8),
)
def test_backlogged_tenants_counters_never_differ_by_more_than_the_bound(tenants, steps, slots) -> None:
    """Every tenant keeps requests waiting; slots free in any order, each request ending with any output up to its
    max_tokens. The tenant served next is the least served, so any two counters differ by at most one request's
    charge U plus the corrections still to come of the requests in flight, each at most C (VTC's bound with the
    batch's term): U = (prompt_cost x longest prompt + output_cost x largest max_tokens) / smallest weight, and
    C = output_cost x largest max_tokens / smallest weight."""
    prompt_cost, output_cost = 1.0, 2.0
    shares = TenantShares(prompt_cost, output_cost)
    queue = CentralQueue(10_000)
    weights = {f"t{i}": w for i, (w,) in enumerate(tenants)}
    lightest = min(weights.values())
    bound_one = (prompt_cost * MAX_PROMPT + output_cost * MAX_OUTPUT) / lightest
    bound_settle = output_cost * MAX_OUTPUT / lightest
    for name, weight in weights.items():
        shares.arrived(name, queue.waiting_per_tenant())
        for _ in range(2):
            queue.push(request(name, weight=weight), 0.0, 1e9)
    running: list[tuple[str, int]] = []
    for pick, prompt, max_tokens, output, finish_first in steps:
        if running and (finish_first or len(running) == slots):
            request_id, asked = running.pop(pick % len(running))
            shares.finished(request_id, min(output, asked))
        if len(running) < slots:
            served = next(queue.in_order(shares))
            queue.remove(served.request_id)
            shares.placed(served.request)
            running.append((served.request_id, served.request.max_tokens))
            tenant = served.request.tenant
            shares.arrived(tenant, queue.waiting_per_tenant())
            queue.push(request(tenant, prompt, max_tokens, weights[tenant]), 0.0, 1e9)
        counters = [shares.counter(name) for name in weights]
        assert max(counters) - min(counters) <= bound_one + slots * bound_settle + 1e-6



def one_slot_fleet(fair_share: bool, max_length: int) -> tuple[Router, list[Heartbeat]]:
    """A router of one node with room for one request, and a queue of `max_length`."""
    fleet = [heartbeat("w", blocks=64)]
    routing = router(queue_length=max_length, queue=QueueSettings(max_length=max_length, fair_share=fair_share,
                                                                  cache_aware_dequeue=False))
    assert isinstance(routing.admit(request("first"), fleet, NOW_WALL), Placement)
    return routing, fleet


def test_a_full_queue_gives_the_place_of_the_tenant_with_most_waiting_to_another_tenant() -> None:
    """Tenant a fills the queue; b's request takes the place of a's newest, which is refused."""
    routing, fleet = one_slot_fleet(True, 3)
    queued = [routing.admit(request("a"), fleet, NOW_WALL) for _ in range(3)]
    assert all(isinstance(q, Queued) and q.evicted is None for q in queued)
    late = routing.admit(request("b"), fleet, NOW_WALL)
    assert isinstance(late, Queued) and late.evicted is not None
    assert late.evicted.request_id == queued[-1].entry.request_id  # type: ignore[union-attr]
    # A tenant whose own requests fill the queue takes no place from another with fewer.
    again = routing.admit(request("a"), fleet, NOW_WALL)
    assert isinstance(again, ErrorReply) and again.code == "queue_full"


def test_arrival_order_keeps_a_full_queue_to_whoever_came_first() -> None:
    routing, fleet = one_slot_fleet(False, 2)
    for _ in range(2):
        assert isinstance(routing.admit(request("a"), fleet, NOW_WALL), Queued)
    late = routing.admit(request("b"), fleet, NOW_WALL)
    assert isinstance(late, ErrorReply) and late.code == "queue_full"
    assert routing.shares is None


def test_the_balancer_shows_the_waiting_tenants_and_forgets_those_no_longer_waiting() -> None:
    from services.balancer.metrics import BalancerMetrics

    metrics = BalancerMetrics()
    shares = TenantShares()
    shares.placed(request("a", prompt=10, max_tokens=5))

    def sample(name: str, tenant: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"tenant": tenant})

    metrics.track_tenants({"a": 2, "": 1}, shares.counter)
    assert sample("kvlane_balancer_tenant_waiting", "a") == 2 and sample("kvlane_balancer_tenant_waiting", "-") == 1
    assert sample("kvlane_balancer_tenant_service_tokens", "a") == 20.0
    metrics.track_tenants({"a": 1}, shares.counter)
    assert sample("kvlane_balancer_tenant_waiting", "-") is None and sample("kvlane_balancer_tenant_waiting", "a") == 1


def test_a_tenant_with_fewer_waiting_than_the_average_is_held_for_its_cache_no_longer_than_the_ttft_target() -> None:
    routing, fleet = one_slot_fleet(True, 100)
    alone = request("a")
    assert routing._hold_limit_s(alone) == routing._queue_settings.cache_aware_max_delay_s  # no other tenant waits
    for _ in range(5):
        routing.admit(request("a"), fleet, NOW_WALL)
    light = request("b")
    routing.admit(light, fleet, NOW_WALL)
    assert routing._hold_limit_s(light) == routing.degradation.ttft_target_s < routing._hold_limit_s(alone)
    fifo, _ = one_slot_fleet(False, 100)
    assert fifo._hold_limit_s(light) == fifo._queue_settings.cache_aware_max_delay_s
