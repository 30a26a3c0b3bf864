"""Which balancer replica a route request goes to: one heard from lately, in turn.

Balancer replicas share a NATS queue group, and NATS hands a replica that
froze (stopped, swapped out, cut off behind a stalled connection) its share
of route requests for as long as its connection stands: each of them waited
out the whole route timeout (`route_timeout_s` plus the longest queue wait)
before it was asked again, and the ask again could meet the same replica.

Each replica also answers on a subject of its own and says it is alive
(`BalancerHeartbeat`). A route request goes to the replicas heard from within
`cluster.heartbeat_ttl_s`, in turn; one that falls silent gets no more, and
the route requests it holds end at once as unanswered (the dispatcher asks
again, elsewhere). Until it has heard any replica (at start, or balancers
that say nothing), an ingress sends to the queue group; not knowing which
replica holds those, it gives them up whenever one falls silent. Once every replica
it heard has fallen silent, none is asked: the ingress holds its route
requests until one beats again (`wait_for_heartbeat`), as it does when no
balancer listens at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from nats.aio.msg import Msg
from opentelemetry.context import Context

from contracts import subjects
from contracts.balancer import BalancerHeartbeat
from contracts.messages import RouteReply, RouteRequest
from services.ingress.metrics import IngressMetrics
from shared.bus import Bus, NoResponders, ReplySlot, RequestTimeout
from shared.periodic import Periodic

log = structlog.get_logger("kvlane.ingress")

# Where route requests sent to the queue group wait: no replica id is ever empty.
_ANY_REPLICA = ""


class BalancerReplicas:
    """The replicas heard from, and when; the caller says what time it is."""

    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._heard: dict[str, float] = {}
        # Said they are stopping, or found no longer listening: chosen no more, but still watched, since a
        # route request sent just before may have been dropped unanswered.
        self._leaving: dict[str, float] = {}
        # Fell silent and not heard since: while only these are known, no replica is there to ask.
        self._silent: set[str] = set()
        self._turn = 0

    def heard(self, heartbeat: BalancerHeartbeat, now: float) -> None:
        self._silent.discard(heartbeat.balancer_id)
        if heartbeat.stopping:
            self._heard.pop(heartbeat.balancer_id, None)
            self._leaving[heartbeat.balancer_id] = now
        else:
            self._heard[heartbeat.balancer_id] = now
            self._leaving.pop(heartbeat.balancer_id, None)

    def forget(self, balancer_id: str) -> None:
        if (at := self._heard.pop(balancer_id, None)) is not None:
            self._leaving[balancer_id] = at

    def live(self, now: float) -> list[str]:
        """The replicas heard from within the TTL."""
        return [balancer_id for balancer_id, at in self._heard.items() if now - at <= self._ttl_s]

    def choose(self, now: float) -> str | None:
        """The next live replica in turn; None when none is."""
        live = self.live(now)
        if not live:
            return None
        self._turn += 1
        return live[self._turn % len(live)]

    def fallen_silent(self, now: float) -> list[str]:
        """The replicas not heard from within the TTL, forgotten here: a heartbeat brings one back."""
        silent = []
        for replicas in (self._heard, self._leaving):
            for balancer_id in [b for b, at in replicas.items() if now - at > self._ttl_s]:
                del replicas[balancer_id]
                silent.append(balancer_id)
                if replicas is self._heard:  # not one that said it stops: it may not be coming back
                    self._silent.add(balancer_id)
        return silent

    def all_silent(self, now: float) -> bool:
        """Whether every replica heard from has fallen silent since (none live, none leaving)."""
        return bool(self._silent) and not self.live(now) and not self._leaving


class _HeldSomewhere:
    """A route request sent to the queue group, which some replica holds: `give_up` ends its wait."""

    def __init__(self) -> None:
        self.given_up = asyncio.Event()
        self.reason = ""

    def give_up(self, reason: str) -> None:
        self.reason = reason
        self.given_up.set()


class RouteAsker:
    """Asks a live balancer replica for a route (`ask`); gives up at once on those held by one that falls silent."""

    def __init__(self, bus: Bus, ttl_s: float = 3.0, check_interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic, metrics: IngressMetrics | None = None) -> None:
        self._bus = bus
        self._metrics = metrics
        self._replicas = BalancerReplicas(ttl_s)
        self._clock = clock
        self._check_interval_s = check_interval_s
        self._checks = Periodic("balancer-silence", check_interval_s, self._check)
        self._last_check = clock()
        # Per replica: the replies its route requests wait for.
        self._waiting: dict[str, set[ReplySlot | _HeldSomewhere]] = {}
        # Set, and replaced, at each heartbeat of a replica that takes routes: wakes route requests held for one.
        self._beat = asyncio.Event()

    async def start(self) -> None:
        await self._bus.subscribe(subjects.BALANCER_HEARTBEAT_ALL, BalancerHeartbeat, self._on_heartbeat,
                                  traced=False, at_once=True)
        self._last_check = self._clock()
        self._checks.start()

    async def stop(self) -> None:
        await self._checks.stop()

    def live_replicas(self) -> list[str]:
        return self._replicas.live(self._clock())

    def _on_heartbeat(self, heartbeat: BalancerHeartbeat, msg: Msg) -> None:
        self._replicas.heard(heartbeat, self._clock())
        if not heartbeat.stopping:
            beat, self._beat = self._beat, asyncio.Event()
            beat.set()

    async def wait_for_heartbeat(self, timeout_s: float) -> bool:
        """Until a balancer replica that takes routes heartbeats, at most `timeout_s`; whether one did."""
        try:
            await asyncio.wait_for(self._beat.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def ask(self, route: RouteRequest, timeout: float, context: Context | None = None) -> RouteReply:
        """The route reply; raises as `Bus.request` does (`RequestTimeout` also when the replica fell silent,
        `NoResponders` also when every replica heard from is silent)."""
        while (balancer_id := self._replicas.choose(self._clock())) is not None:
            subject = subjects.balancer_route(balancer_id)
            waiting = self._waiting.setdefault(balancer_id, set())
            with await self._bus.reply_slot() as slot:
                waiting.add(slot)
                if self._waiting.get(balancer_id) is not waiting:
                    continue  # it fell silent just now, and this request was not among those given up
                try:
                    await self._bus.publish(subject, route, reply=slot.subject, context=context)
                    return await slot.wait(RouteReply, timeout, subject)
                except NoResponders:
                    self._replicas.forget(balancer_id)  # it stopped taking routes: the next one, or the queue group
                finally:
                    waiting.discard(slot)
        if self._replicas.all_silent(self._clock()):
            # The queue group would hand it to a silent replica that still holds its connection (a frozen one).
            raise NoResponders("every balancer replica heard from is silent")
        # Held by whichever replica the queue group chose: given up when any replica falls silent, as it may be that one.
        held = _HeldSomewhere()
        waiting = self._waiting.setdefault(_ANY_REPLICA, set())
        waiting.add(held)
        asking = asyncio.ensure_future(self._bus.request(subjects.ROUTE, route, RouteReply, timeout, context=context))
        given_up = asyncio.ensure_future(held.given_up.wait())
        try:
            await asyncio.wait([asking, given_up], return_when=asyncio.FIRST_COMPLETED)
            if not asking.done():
                raise RequestTimeout(held.reason)
            return asking.result()
        finally:
            waiting.discard(held)
            given_up.cancel()
            if not asking.done():
                asking.cancel()

    async def _check(self) -> None:
        now = self._clock()
        stalled = now - self._last_check > 2 * self._check_interval_s
        self._last_check = now
        if stalled:
            # This process itself was held up: the heartbeats it missed may still wait unread in its socket.
            return
        for balancer_id in self._replicas.fallen_silent(now):
            held = self._waiting.pop(balancer_id, set()) | self._waiting.pop(_ANY_REPLICA, set())
            for slot in held:
                slot.give_up(f"balancer {balancer_id} went silent")
            log.warning("balancer_silent", balancer_id=balancer_id, routes_given_up=len(held))
            if self._metrics is not None:
                self._metrics.balancer_silent(len(held))
        if self._metrics is not None:
            self._metrics.balancer_replicas(len(self._replicas.live(now)))
