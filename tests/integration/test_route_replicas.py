"""Route requests to balancer replicas heard from lately (`RouteAsker`), against a real nats-server.

The replicas here speak the balancer's protocol (a route subject of their own, the queue group, heartbeats) and
nothing else, so that each can be frozen, stopped or silenced at will; `test_faults.py` freezes a real balancer
process under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

import pytest

from contracts import subjects
from contracts.balancer import BalancerHeartbeat
from contracts.messages import RouteDecision, RouteRequest
from services.ingress.balancers import RouteAsker
from services.ingress.metrics import IngressMetrics
from shared.bus import Bus, RequestTimeout
from tests.integration.test_bus import connect, nats_server, route  # noqa: F401 (a fixture)
from tests.waiting import until

pytestmark = pytest.mark.integration

TTL_S = 1.0
BEAT_S = 0.1
# Far longer than any wait these tests allow: a request given up sooner was given up on the replica's silence.
ROUTE_TIMEOUT_S = 30.0
PROBES = itertools.count()


class Replica:
    """A balancer replica: answers on its own subject and in the queue group, says it is alive while `beating`."""

    def __init__(self, bus: Bus, balancer_id: str) -> None:
        self.bus, self.balancer_id = bus, balancer_id
        self.answered: list[str] = []
        self.held: list[str] = []
        self.frozen = False
        self.beating = True
        self._subscriptions: list = []
        self._beats: asyncio.Task | None = None

    async def start(self) -> None:
        self._subscriptions = [
            await self.bus.subscribe(subjects.balancer_route(self.balancer_id), RouteRequest, self._on_route, concurrent=True),
            await self.bus.subscribe(subjects.ROUTE, RouteRequest, self._on_route, queue=subjects.BALANCER_QUEUE_GROUP,
                                     concurrent=True),
        ]
        self._beats = asyncio.create_task(self._beat())

    async def stop_answering(self) -> None:
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        # Twice: nats-py sends a flush's PING ahead of what it queued (`Bus.subscribe`).
        await self.bus.flush()
        await self.bus.flush()

    async def say_stopping(self) -> None:
        self.beating = False
        await self.bus.publish(subjects.balancer_heartbeat(self.balancer_id), BalancerHeartbeat(self.balancer_id, stopping=True))

    async def close(self) -> None:
        if self._beats is not None:
            self._beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._beats

    async def _beat(self) -> None:
        while True:
            if self.beating:
                await self.bus.publish(subjects.balancer_heartbeat(self.balancer_id), BalancerHeartbeat(self.balancer_id))
            await asyncio.sleep(BEAT_S)

    async def _on_route(self, request: RouteRequest, msg: object) -> RouteDecision:
        if self.frozen:
            self.held.append(request.request_id)
            await asyncio.Event().wait()  # a frozen process answers nothing, ever
        self.answered.append(request.request_id)
        return RouteDecision(request.request_id, "w0", subjects.worker_inbox("w0"), self.balancer_id)


@pytest.fixture
async def fleet(nats_server) -> AsyncIterator[tuple[RouteAsker, Replica, Replica, IngressMetrics]]:  # noqa: F811
    _, port = nats_server
    buses = [(await connect(port, name))[0] for name in ("ingress", "b-a", "b-b")]
    metrics = IngressMetrics()
    asker = RouteAsker(buses[0], ttl_s=TTL_S, check_interval_s=0.05, metrics=metrics)
    await asker.start()
    replicas = Replica(buses[1], "b-a"), Replica(buses[2], "b-b")
    for replica in replicas:
        await replica.start()
    yield asker, *replicas, metrics
    await asker.stop()
    for replica in replicas:
        await replica.close()
    for bus in buses:
        await bus.close()


async def ask(asker: RouteAsker, request_id: str) -> str:
    """The id of the replica that decided."""
    reply = await asker.ask(route(request_id), ROUTE_TIMEOUT_S)
    assert isinstance(reply, RouteDecision), reply
    return reply.policy


async def both_heard(asker: RouteAsker) -> bool:
    """Whether two requests in a row went to two replicas (each replica's own subject, in turn)."""
    return {await ask(asker, f"probe-{next(PROBES)}") for _ in range(2)} == {"b-a", "b-b"}


async def test_requests_go_to_each_replica_in_turn_and_those_a_frozen_one_holds_are_given_up_at_once(fleet) -> None:
    asker, a, b, metrics = fleet
    metric = metrics.registry.get_sample_value
    await until(lambda: both_heard(asker), 10, "both replicas chosen")
    await until(lambda: metric("kvlane_ingress_balancer_replicas") == 2, 10, "two replicas in the metric")
    assert [await ask(asker, f"r{k}") for k in range(4)] in (["b-a", "b-b"] * 2, ["b-b", "b-a"] * 2)

    b.frozen, b.beating = True, False
    frozen_at = time.monotonic()
    outcomes = await asyncio.gather(*(ask(asker, f"f{k}") for k in range(6)), return_exceptions=True)
    given_up = [o for o in outcomes if isinstance(o, RequestTimeout)]
    # b was still heard from when these went out: it held its share, each given up once it had been silent for the TTL
    # (and not after the route timeout); a answered the rest.
    assert given_up and all("b-b went silent" in str(o) for o in given_up), outcomes
    assert sorted(b.held) == sorted(f"f{k}" for k, o in enumerate(outcomes) if isinstance(o, RequestTimeout))
    assert all(o == "b-a" for o in outcomes if not isinstance(o, RequestTimeout)), outcomes
    assert time.monotonic() - frozen_at < ROUTE_TIMEOUT_S / 3
    # Silent, it gets nothing more; operators see it went silent and what it held.
    assert [await ask(asker, f"s{k}") for k in range(4)] == ["b-a"] * 4
    assert metric("kvlane_ingress_balancer_silences_total") == 1
    assert metric("kvlane_ingress_routes_given_up_total") == len(given_up)
    assert metric("kvlane_ingress_balancer_replicas") == 1

    b.frozen, b.beating = False, True  # awake again: heard, and chosen again
    await until(lambda: both_heard(asker), 10, "b chosen again once it beats")


async def test_a_stopping_replica_is_forgotten_and_one_that_stopped_answering_is_passed_over(fleet) -> None:
    asker, a, b, _ = fleet
    await until(lambda: both_heard(asker), 10, "both replicas chosen")
    await b.say_stopping()
    await until(lambda: b.balancer_id not in asker.live_replicas(), 10, "b forgotten")
    assert [await ask(asker, f"r{k}") for k in range(4)] == ["b-a"] * 4

    # Still heard, but no longer subscribed (it stopped between two heartbeats): NATS says nobody listens,
    # and the request goes to the other replica at once.
    b.beating = True
    await until(lambda: both_heard(asker), 10, "b heard again")
    await b.stop_answering()
    started = time.monotonic()
    assert [await ask(asker, f"n{k}") for k in range(4)] == ["b-a"] * 4
    assert time.monotonic() - started < ROUTE_TIMEOUT_S / 3
    assert not any(r.startswith("n") for r in b.answered)


async def test_requests_a_stopping_replica_dropped_are_given_up_once_it_has_been_silent_for_the_ttl(fleet) -> None:
    asker, a, b, _ = fleet
    await until(lambda: both_heard(asker), 10, "both replicas chosen")
    b.frozen = True
    held = asyncio.gather(*(ask(asker, f"h{k}") for k in range(4)), return_exceptions=True)
    await until(lambda: b.held, 10, "b holds a request")
    await b.say_stopping()  # and never answers what it holds (dropped, as between an UNSUB and its flush)
    stopped_at = time.monotonic()
    outcomes = await held
    assert [o for o in outcomes if isinstance(o, RequestTimeout)], outcomes
    assert all("b-b went silent" in str(o) for o in outcomes if isinstance(o, RequestTimeout)), outcomes
    assert TTL_S * 0.9 < time.monotonic() - stopped_at < ROUTE_TIMEOUT_S / 3


async def test_with_no_replica_heard_from_requests_go_to_the_queue_group(fleet) -> None:
    asker, a, b, _ = fleet
    for replica in (a, b):
        await replica.say_stopping()
    await until(lambda: not asker.live_replicas(), 10, "both forgotten")
    answered_by = {await ask(asker, f"q{k}") for k in range(8)}
    assert answered_by <= {"b-a", "b-b"} and answered_by  # the queue group's members answered
    assert {r for r in a.answered + b.answered if r.startswith("q")} == {f"q{k}" for k in range(8)}



async def test_requests_sent_to_the_queue_group_are_given_up_when_a_replica_falls_silent(fleet) -> None:
    asker, a, b, metrics = fleet
    await until(lambda: both_heard(asker), 10, "both replicas chosen")
    b.frozen = True
    for replica in (a, b):
        await replica.say_stopping()
    await until(lambda: not asker.live_replicas(), 10, "both forgotten")
    sent_at = time.monotonic()
    # Which replica holds one is the queue group's choice: the ingress cannot tell, so it gives up every one it sent
    # there once a replica falls silent (the frozen one among them), and the dispatcher asks those again.
    outcomes = await asyncio.gather(*(ask(asker, f"g{k}") for k in range(16)), return_exceptions=True)
    given_up = [f"g{k}" for k, o in enumerate(outcomes) if isinstance(o, RequestTimeout)]
    assert given_up and sorted(given_up) == sorted(b.held), outcomes
    assert all(o == "b-a" for o in outcomes if not isinstance(o, RequestTimeout)), outcomes
    assert time.monotonic() - sent_at < ROUTE_TIMEOUT_S / 3
    assert metrics.registry.get_sample_value("kvlane_ingress_routes_given_up_total") == len(given_up)
