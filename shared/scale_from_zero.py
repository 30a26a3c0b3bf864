"""Which models an ingress and a balancer take requests for while no worker serves them.

The autoscaler names them in each `ScalingDecision` (`from_zero`): the
models of pools that may scale to zero, each with the registration its last
worker sent. `ModelsFromZero` keeps the latest decision's list (pure);
`ModelsFromZeroWatcher` feeds it, at start, the decision the autoscaler
last stored in Redis (so a process that starts while a pool is at zero knows
at once), then each decision heard on NATS.
"""

from __future__ import annotations

import msgspec
import redis.exceptions
import structlog
from nats.aio.msg import Msg
from redis.asyncio import Redis

from contracts import subjects
from contracts.autoscaler import ScalingDecision
from contracts.messages import WorkerRegistration
from shared.bus import Bus

log = structlog.get_logger("kvlane.scale_from_zero")


class ModelsFromZero:
    """The models the last decision heard says may be served from zero, with the registration to serve them as."""

    def __init__(self) -> None:
        self._registrations: dict[str, WorkerRegistration] = {}

    def heard(self, decision: ScalingDecision) -> None:
        """`decision` replaces the one before, whenever it says it was made: a decision stamped far ahead by a
        clock gone wrong must not hide the next ones."""
        self._registrations = {registration.model: registration for registration in decision.from_zero}

    def registration(self, model: str) -> WorkerRegistration | None:
        return self._registrations.get(model)

    def __contains__(self, model: object) -> bool:
        return model in self._registrations

    def models(self) -> list[str]:
        return sorted(self._registrations)


class ModelsFromZeroWatcher:
    def __init__(self, bus: Bus, redis: Redis, models: ModelsFromZero | None = None) -> None:
        self._bus = bus
        self._redis = redis
        self.models = models or ModelsFromZero()

    async def start(self) -> None:
        """The stored decision first: one heard on NATS meanwhile is newer (a decision missed between the two is
        followed by the next within `autoscaler.interval_s`)."""
        try:
            stored = await self._redis.get(subjects.AUTOSCALER_DECISION_KEY)
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("autoscaler_decision_unread", error=str(exc))
            stored = None
        if stored is not None:
            try:
                self.models.heard(msgspec.json.decode(stored, type=ScalingDecision))
            except msgspec.DecodeError as exc:
                log.warning("bad_autoscaler_decision", error=str(exc))
        await self._bus.subscribe(subjects.AUTOSCALER_DECISION, ScalingDecision, self._on_decision, traced=False)

    async def _on_decision(self, decision: ScalingDecision, msg: Msg) -> None:
        self.models.heard(decision)
