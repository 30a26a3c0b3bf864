"""How ingresses find one balancer replica: where it takes route requests, and its heartbeats.

It takes them on the replicas' queue group subject and on a subject of its
own, which an ingress uses while it hears the replica's heartbeats
(`services/ingress/balancers.py`). Stopping, it leaves both and says so in a
last heartbeat, so that ingresses send it nothing more at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from contracts import subjects
from contracts.balancer import BalancerHeartbeat
from contracts.messages import RouteReply, RouteRequest
from shared.bus import Bus
from shared.periodic import Periodic


class ReplicaPresence:
    def __init__(self, bus: Bus, balancer_id: str, heartbeat_interval_s: float,
                 on_route: Callable[[RouteRequest, Msg], Awaitable[RouteReply]]) -> None:
        self._bus = bus
        self._balancer_id = balancer_id
        self._on_route = on_route
        # Not from the balancer's tick: a tick waits on Redis, and a replica that answers routes must not seem silent.
        self._heartbeats = Periodic("balancer-heartbeat", heartbeat_interval_s, self._say_alive, immediately=True)
        self._subscriptions: list = []

    async def start(self) -> None:
        # Queued requests hold their handler open, so each route request runs as its own task. The span names
        # the queue group's subject either way: one name for one kind of request in a trace console.
        self._subscriptions = [
            await self._bus.subscribe(subjects.ROUTE, RouteRequest, self._on_route, queue=subjects.BALANCER_QUEUE_GROUP,
                                      concurrent=True),
            await self._bus.subscribe(subjects.balancer_route(self._balancer_id), RouteRequest, self._on_route,
                                      concurrent=True, span_name=subjects.ROUTE),
        ]
        self._heartbeats.start()

    async def stop(self) -> None:
        """Take no more route requests: later ones go to the other replicas; those sent here meanwhile find no
        responders, and an ingress that hears the last heartbeat sends no more."""
        await self._heartbeats.stop()
        for subscription in self._subscriptions:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        with contextlib.suppress(Exception):
            await self._say_alive(stopping=True)

    async def _say_alive(self, stopping: bool = False) -> None:
        await self._bus.publish(subjects.balancer_heartbeat(self._balancer_id),
                                BalancerHeartbeat(self._balancer_id, stopping), traced=False)
