"""The autoscaler service: gathers the fleet's signals, asks the core each interval, publishes what it decided.

Signals: every `RequestServed` the ingresses publish (the latencies clients
saw), the live nodes' heartbeats (replicas, KV usage, engine queues per
role) and a balancer's central queue. Each decision goes out on
`kvlane.v1.autoscaler.decision`, into Redis (the latest one, for actuators
that poll, such as `kvlane up --autoscale`), and into the metrics
`kvlane_autoscaler_desired_replicas{pool}` that KEDA or an HPA can act on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import structlog
from nats.aio.msg import Msg
from redis.asyncio import Redis

from contracts import subjects
from contracts.autoscaler import RequestServed, ScalingDecision
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

    async def start(self) -> None:
        await self._bus.subscribe(subjects.REQUEST_SERVED, RequestServed, self._on_served, traced=False)
        self._ticker.start()

    async def stop(self) -> None:
        await self._ticker.stop()

    async def _on_served(self, served: RequestServed, msg: Msg) -> None:
        self._observations.served(self._clock(), served.ttft_s, served.tpot_s)

    async def tick(self) -> ScalingDecision:
        now = self._clock()
        gauges = pool_gauges(self._view.live(time.monotonic()), await self._central_queue())
        self._observations.gauges(now, gauges)
        self._observations.forget_before(now)
        pools = self._core.decide(now, self._observations, {pool: g.replicas for pool, g in gauges.items()})
        decision = ScalingDecision(self._id, now, pools)
        self.metrics.record(decision)
        await self._bus.publish(subjects.AUTOSCALER_DECISION, decision)
        await self._redis.set(subjects.AUTOSCALER_DECISION_KEY, msgspec.json.encode(decision))
        if self.last is None or decision.desired() != self.last.desired():
            log.info("scaling", **{p.pool: f"{p.current}->{p.desired} ({p.reason})" for p in pools})
        self.last = decision
        return decision

    async def _central_queue(self) -> int:
        """Requests queued in a balancer (0 when none answers: the engines' queues still count)."""
        try:
            reply = await self._bus.request(subjects.BALANCER_STATUS, BalancerStatusRequest(), BalancerStatusReply, timeout=1.0)
        except BusError:
            return 0
        return reply.queue_length if isinstance(reply, BalancerStatus) else 0
