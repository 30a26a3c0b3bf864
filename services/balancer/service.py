"""The balancer: answers route requests with the node a policy picks.

Any number of balancers share the `kvlane.v1.route` queue group. Each keeps
its own view of the cluster (heartbeats + Redis) and counts the requests it
routed until their `RequestFinished` event arrives.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
from nats.aio.msg import Msg

from contracts import subjects
from contracts.messages import ErrorReply, RequestFinished, RouteDecision, RouteReply, RouteRequest
from services.balancer.outstanding import OutstandingRequests
from services.balancer.policies import Candidate, RoutingPolicy
from shared.bus import Bus
from shared.cluster import ClusterView

log = structlog.get_logger("kvlane.balancer")


class BalancerService:
    def __init__(
        self,
        bus: Bus,
        view: ClusterView,
        policy: RoutingPolicy,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._bus = bus
        self._view = view
        self._policy = policy
        self._clock = clock
        self._wall_clock = wall_clock
        self._outstanding = OutstandingRequests()

    async def start(self) -> None:
        await self._bus.subscribe(subjects.ROUTE, RouteRequest, self._on_route, queue=subjects.BALANCER_QUEUE_GROUP)
        await self._bus.subscribe(subjects.REQUEST_FINISHED, RequestFinished, self._on_finished, traced=False)

    async def _on_route(self, request: RouteRequest, msg: Msg) -> RouteReply:
        return self.route(request)

    async def _on_finished(self, event: RequestFinished, msg: Msg) -> None:
        self._outstanding.finish(event.request_id)

    def route(self, request: RouteRequest) -> RouteReply:
        now = self._wall_clock()
        if request.deadline <= now:
            return ErrorReply(code="deadline_exceeded", message="request deadline passed before routing", status=504)
        self._outstanding.expire(now)
        nodes = self._view.routable(self._clock(), request.model)
        if not nodes:
            if not any(hb.registration.model == request.model for hb in self._view.live(self._clock())):
                return ErrorReply(code="model_not_found", message=f"no live worker serves model {request.model!r}", status=404)
            return ErrorReply(code="no_capacity", message="every worker for this model is draining", status=503, retry_after_s=1.0)
        excluded = set(request.exclude_workers)
        candidates = [
            Candidate(
                worker_id=hb.registration.worker_id,
                inbox=hb.registration.inbox,
                running=hb.stats.running,
                waiting=hb.stats.waiting,
                outstanding=self._outstanding.count(hb.registration.worker_id),
                kv_usage=hb.stats.kv_blocks_used / hb.stats.kv_blocks_total if hb.stats.kv_blocks_total else 0.0,
            )
            for hb in nodes
            if hb.registration.worker_id not in excluded
        ]
        if not candidates:
            return ErrorReply(code="no_capacity", message="no other live worker to retry on", status=503, retry_after_s=1.0)
        chosen = self._policy.choose(request, candidates)
        if chosen is None:
            return ErrorReply(code="no_capacity", message="no worker can take the request now", status=503, retry_after_s=1.0)
        self._outstanding.add(request.request_id, chosen.worker_id, request.deadline)
        log.debug("routed", request_id=request.request_id, worker_id=chosen.worker_id, load=chosen.load)
        return RouteDecision(request.request_id, chosen.worker_id, chosen.inbox, self._policy.name)
