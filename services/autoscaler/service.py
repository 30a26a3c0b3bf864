"""The autoscaler service: gathers the fleet's signals, asks the core each interval, publishes what it decided.

Signals: every `RequestServed` the ingresses publish (the latencies clients
saw, per model), the live nodes' heartbeats (replicas, KV usage, engine
queues per model and role) and a balancer's central queue per model. Each
decision, one per pool (model and role), goes out on
`kvlane.v1.autoscaler.decision`, into Redis (the latest one, for actuators
that poll, such as `kvlane up --autoscale`), and into the metrics
`kvlane_autoscaler_desired_replicas{model_name,pool}` that KEDA or an HPA can act on.

A balancer holding a request for a model no worker serves says so on
`kvlane.v1.autoscaler.wake` (`ScaleUpWanted`): the autoscaler decides at
once rather than at its next interval, so a pool at zero starts its first
worker without waiting up to `interval_s` more.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import redis.exceptions
import structlog
from nats.aio.msg import Msg
from redis.asyncio import Redis

from contracts import subjects
from contracts.autoscaler import PoolKey, RequestServed, ScaleUpWanted, ScalingDecision
from contracts.balancer import BalancerStatus, BalancerStatusReply, BalancerStatusRequest
from services.autoscaler.core import Autoscaler, Observations, pool_gauges
from services.autoscaler.metrics import AutoscalerMetrics
from shared.bus import Bus, BusError
from shared.cluster import ClusterView
from shared.config import AutoscalerSettings
from shared.periodic import Periodic

log = structlog.get_logger("kvlane.autoscaler")

class AutoscalerService:
    def __init__(
        self,
        settings: AutoscalerSettings,
        bus: Bus,
        view: ClusterView,
        redis: Redis,
        autoscaler_id: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._settings = settings
        self._bus = bus
        self._view = view
        self._redis = redis
        self._id = autoscaler_id
        self._clock = clock
        self._core = Autoscaler(settings)
        self._observations = Observations(settings.stable_window_s)
        self.metrics = AutoscalerMetrics()
        self._ticker = Periodic("autoscale", settings.interval_s, self.tick)
        self.last: ScalingDecision | None = None
        # A wake decides between two periodic ticks: one decision at a time.
        self._deciding = asyncio.Lock()

    async def start(self) -> None:
        await self._remember_stored()
        await self._bus.subscribe(subjects.REQUEST_SERVED, RequestServed, self._on_served, traced=False)
        await self._bus.subscribe(subjects.AUTOSCALER_WAKE, ScaleUpWanted, self._on_wake, traced=False)
        self._ticker.start()

    async def _remember_stored(self) -> None:
        """The models served from zero that an earlier autoscaler knew: their workers may all be gone now."""
        try:
            stored = await self._redis.get(subjects.AUTOSCALER_DECISION_KEY)
            if stored is not None:
                self._core.remember(msgspec.json.decode(stored, type=ScalingDecision).from_zero)
        except (msgspec.DecodeError, redis.exceptions.RedisError, OSError) as exc:
            log.warning("stored_decision_unread", error=str(exc))

    async def stop(self) -> None:
        await self._ticker.stop()

    async def _on_served(self, served: RequestServed, msg: Msg) -> None:
        now = self._clock()
        self._observations.served(now, served.model, served.ttft_s, served.tpot_s, arrived_at=now - served.e2e_s)

    async def _on_wake(self, wanted: ScaleUpWanted, msg: Msg) -> None:
        pools = self._core.wake(self._clock(), wanted.model)
        if not pools:
            log.warning("wake_for_unknown_model", model=wanted.model, balancer_id=wanted.balancer_id)
            return
        if self.last is None or any(self.last.desired().get(PoolKey(wanted.model, pool), 0) == 0 for pool in pools):
            log.info("woken", model=wanted.model, held=wanted.held, pools=pools, balancer_id=wanted.balancer_id)
            await self.tick()

    async def tick(self) -> ScalingDecision:
        async with self._deciding:
            return await self._decide()

    async def _decide(self) -> ScalingDecision:
        live = self._view.live(time.monotonic())
        gauges = pool_gauges(live, await self._central_queue())
        now = self._clock()
        self._core.remember(hb.registration for hb in live)
        self._observations.gauges(now, gauges)
        self._observations.forget_before(now)
        pools = self._core.decide(now, self._observations, {pool: g.replicas for pool, g in gauges.items()})
        decision = ScalingDecision(self._id, now, pools, self._core.from_zero())
        self.metrics.record(decision)
        await self._bus.publish(subjects.AUTOSCALER_DECISION, decision)
        await self._redis.set(subjects.AUTOSCALER_DECISION_KEY, msgspec.json.encode(decision))
        if self.last is None or decision.desired() != self.last.desired():
            log.info("scaling", **{f"{p.model}/{p.pool}": f"{p.current}->{p.desired} ({p.reason})" for p in pools})
        self.last = decision
        return decision

    async def _central_queue(self) -> dict[str, int]:
        """Requests queued in a balancer per model, under "" when it does not count them per model (none when none
        answers: the engines' queues still count)."""
        try:
            reply = await self._bus.request(subjects.BALANCER_STATUS, BalancerStatusRequest(), BalancerStatusReply, timeout=1.0)
        except BusError:
            return {}
        if not isinstance(reply, BalancerStatus):
            return {}
        return dict(reply.queued_per_model) if reply.queued_per_model else {"": reply.queue_length}
