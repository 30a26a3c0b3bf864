"""The health-prober: canary probes, client feedback, verdicts.

Every `probe_interval_s` it sends each live worker a one-token request
straight to the worker's inbox (bypassing the balancer, so it measures the
node and nothing else) and times it to the end of the stream. Verdicts for
every node are published on `kvlane.v1.health.<id>` and kept in Redis
(`kvlane:v1:health:<id>`, with a TTL) after each round.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Callable

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from redis.exceptions import RedisError

from contracts import subjects
from contracts.health import NodeFeedback
from contracts.messages import ErrorReply, GenerateRequest, Heartbeat, SamplingParams, StreamEnd, WorkerReply
from services.health_prober.health import NodeHealth
from services.health_prober.metrics import HealthMetrics
from shared.bus import Bus, BusError, RequestTimeout, StreamReceiver, is_final
from shared.cluster import ClusterView
from shared.config import HealthSettings
from shared.periodic import Periodic

log = structlog.get_logger("kvlane.health_prober")

# Any short prompt does: the probe measures the node, not the model.
_PROBE_PROMPT = [3, 4, 5, 6, 7, 8, 9, 10]


class HealthProberService:
    def __init__(
        self,
        settings: HealthSettings,
        bus: Bus,
        view: ClusterView,
        streams: StreamReceiver,
        redis_client,
        clock: Callable[[], float] = time.monotonic,
        metrics: HealthMetrics | None = None,
    ) -> None:
        self._settings = settings
        self._bus = bus
        self._view = view
        self._streams = streams
        self._redis = redis_client
        self._clock = clock
        self.nodes: dict[str, NodeHealth] = {}
        self.metrics = metrics or HealthMetrics()
        self.metrics.watch(lambda: self.nodes.values())
        self._counter = itertools.count()
        self._encoder = msgspec.json.Encoder()
        self._rounds = Periodic("health-probes", settings.probe_interval_s, self.probe_round, immediately=True)

    async def start(self) -> None:
        await self._bus.subscribe(subjects.FEEDBACK, NodeFeedback, self._on_feedback, traced=False)
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()

    def _node(self, worker_id: str) -> NodeHealth:
        node = self.nodes.get(worker_id)
        if node is None:
            node = self.nodes[worker_id] = NodeHealth(worker_id, self._settings, time.time())
        return node

    async def _on_feedback(self, feedback: NodeFeedback, msg: Msg) -> None:
        node = self._node(feedback.worker_id)
        before = node.state
        node.observe_feedback(feedback.kind, time.time(), feedback.started_at)
        self.metrics.feedback.labels(feedback.kind).inc()
        if self._changed(node, before):
            await self._publish(node)

    async def probe_round(self) -> None:
        live = [hb for hb in self._view.live(self._clock()) if not hb.draining]
        for gone in set(self.nodes) - {hb.registration.worker_id for hb in live}:
            del self.nodes[gone]
        now = time.time()
        for hb in live:
            node = self._node(hb.registration.worker_id)
            before = node.state
            if node.started(hb.registration.started_at, now):
                if not self._changed(node, before):
                    log.info("health_reset", worker_id=node.worker_id, state=node.state, reason=node.reason)
                await self._publish(node)  # at once: the probes below may take up to their timeout
        latencies = await asyncio.gather(*(self.probe(hb) for hb in live))
        now = time.time()
        for hb, latency in zip(live, latencies, strict=True):
            node = self._node(hb.registration.worker_id)
            before = node.state
            node.observe_probe(latency, now, queued=hb.stats.waiting > 0)
            self._count_probe(latency)
            self._changed(node, before)
            await self._publish(node)

    def _changed(self, node: NodeHealth, before: str) -> bool:
        """Whether `node`'s verdict is no longer `before`; a change is counted and logged."""
        if node.state == before:
            return False
        self.metrics.transitions.labels(node.state).inc()
        log.warning("health_changed", worker_id=node.worker_id, state=node.state, was=before, reason=node.reason)
        return True

    def _count_probe(self, latency: float | None) -> None:
        if latency is None:
            self.metrics.probes.labels("failed").inc()
        elif math.isinf(latency):
            self.metrics.probes.labels("timeout").inc()
        else:
            self.metrics.probes.labels("ok").inc()
            self.metrics.probe_seconds.observe(latency)

    async def probe(self, heartbeat: Heartbeat) -> float | None:
        """Seconds to a complete one-token answer; `math.inf` if it timed out, None if it failed."""
        registration = heartbeat.registration
        request_id = f"probe-{registration.worker_id}-{next(self._counter)}"[:64]
        timeout = self._settings.probe_timeout_s
        started = self._clock()
        with self._streams.open(request_id) as stream:
            request = GenerateRequest(
                request_id=request_id,
                model=registration.model,
                prompt_token_ids=_PROBE_PROMPT,
                sampling=SamplingParams(max_tokens=1, temperature=0.0),
                stream_to=stream.subject,
                timeout_s=timeout,
            )
            try:
                reply = await self._bus.request(registration.inbox, request, WorkerReply, timeout)
                if isinstance(reply, ErrorReply):
                    return None
                while True:
                    remaining = timeout - (self._clock() - started)
                    frame = await stream.next(max(remaining, 0.001))
                    if is_final(frame):
                        return self._clock() - started if isinstance(frame, StreamEnd) else None
            except RequestTimeout:
                return math.inf
            except (BusError, nats.errors.Error):  # one node's failure is its own, not the whole round's
                return None

    async def _publish(self, node: NodeHealth) -> None:
        verdict = node.verdict(time.time())
        try:
            await self._bus.publish(subjects.health(node.worker_id), verdict, traced=False)
        except Exception as exc:
            log.warning("verdict_publish_failed", error=str(exc))
        try:
            await self._redis.set(subjects.health_key(node.worker_id), self._encoder.encode(verdict),
                                  px=int(self._settings.verdict_ttl_s * 1000))
        except (RedisError, OSError) as exc:
            log.warning("verdict_store_failed", error=str(exc))
