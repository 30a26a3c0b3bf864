"""Each process's in-memory view of the live workers.

`ClusterView` is the pure part: it keeps the newest heartbeat per worker
and answers which workers are alive at a given instant (a worker is stale
once its last heartbeat is older than the TTL). `ClusterWatcher` feeds it
from heartbeats on NATS and re-reads Redis now and then, which rebuilds the
view after this process or NATS restarts.

Between full heartbeats workers send `LoadReport`s (shared/heartbeats.py):
`ClusterView.assemble` joins each to the registration the view holds for
its worker, and ignores one whose registration it does not hold yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import redis.exceptions
import structlog
from nats.aio.msg import Msg

from contracts import subjects
from contracts.messages import EngineStats, Heartbeat, HeartbeatMessage, LoadReport, WorkerLeft, WorkerRegistration
from shared.bus import Bus
from shared.periodic import Periodic
from shared.state import ClusterState

log = structlog.get_logger("kvlane.cluster")


class NodeEntry(msgspec.Struct):
    heartbeat: Heartbeat
    seen_at: float


class ClusterView:
    def __init__(self, ttl_s: float) -> None:
        self._ttl_s = ttl_s
        self._nodes: dict[str, NodeEntry] = {}
        # Load reports that named a registration this view did not hold (it started late, or missed a change).
        self.unmatched_load_reports = 0
        # `models()` is asked on every request; its answer holds until a node it did not count is heard, a node
        # leaves or changes model or draining, or the first node it counted on goes stale.
        self._models: dict[str, WorkerRegistration] | None = None
        # From when `_models` holds, and the oldest sighting among the nodes it counted: it holds while that node is
        # live, judged by the same expression as `live` (a precomputed expiry instant can round the other way).
        self._models_valid = (float("inf"), float("inf"))
        self._models_counted: frozenset[str] = frozenset()  # the nodes live when it was read

    def assemble(self, message: HeartbeatMessage) -> Heartbeat | None:
        """The full heartbeat `message` stands for: itself, or a load report joined to its worker's registration.

        None when the view holds no registration with the report's digest: it learns it from the
        worker's next full heartbeat or the next resync from Redis.
        """
        if not isinstance(message, LoadReport):
            return message
        entry = self._nodes.get(message.worker_id)
        if entry is None or entry.heartbeat.registration_digest != message.registration_digest:
            self.unmatched_load_reports += 1
            return None
        stats = EngineStats(*msgspec.structs.astuple(message.stats))  # not the packed form, should anyone encode it again
        return Heartbeat(entry.heartbeat.registration, stats, message.sent_at, message.seq, message.draining, message.registration_digest)

    def observe(self, heartbeat: Heartbeat, seen_at: float) -> None:
        """Keep `heartbeat` unless a newer one from the same worker is known."""
        worker_id = heartbeat.registration.worker_id
        entry = self._nodes.get(worker_id)
        if entry is not None and entry.heartbeat.sent_at > heartbeat.sent_at:
            return
        if entry is not None and entry.seen_at > seen_at and entry.heartbeat.sent_at == heartbeat.sent_at:
            return
        self._nodes[worker_id] = NodeEntry(heartbeat, seen_at)
        # A node `models` did not count (new, or stale then: a resync's heartbeat, seen as of when Redis stored it,
        # can bring one back without moving its last sighting past the TTL), one that changed what `models` reads,
        # or one now due to go stale sooner than the answer assumed, changes its answer.
        if (entry is None or worker_id not in self._models_counted or seen_at < self._models_valid[1]
                or entry.heartbeat.draining != heartbeat.draining or entry.heartbeat.registration != heartbeat.registration):
            self._models = None

    def remove(self, worker_id: str) -> None:
        if self._nodes.pop(worker_id, None) is not None:
            self._models = None

    def prune(self, now: float) -> list[str]:
        stale = [wid for wid, entry in self._nodes.items() if now - entry.seen_at > self._ttl_s]
        for worker_id in stale:
            del self._nodes[worker_id]
        if stale:
            self._models = None
        return stale

    def live_start(self, worker_id: str, now: float) -> float | None:
        """When the process now heartbeating as `worker_id` started (its `started_at`); None when no such node is live.

        A node restarted under its id within the heartbeat TTL is never seen gone: only its start tells it changed.
        """
        entry = self._nodes.get(worker_id)
        if entry is None or now - entry.seen_at > self._ttl_s:
            return None
        return entry.heartbeat.registration.started_at

    def live(self, now: float) -> list[Heartbeat]:
        return [e.heartbeat for e in self._nodes.values() if now - e.seen_at <= self._ttl_s]

    def routable(self, now: float, model: str) -> list[Heartbeat]:
        return [hb for hb in self.live(now) if not hb.draining and hb.registration.model == model]

    def models(self, now: float) -> dict[str, WorkerRegistration]:
        """One registration per served model (any live, non-draining worker's). Do not change what it returns."""
        since, oldest_seen = self._models_valid
        if self._models is None or now < since or now - oldest_seen > self._ttl_s:
            live = [e for e in self._nodes.values() if now - e.seen_at <= self._ttl_s]
            self._models = {}
            for entry in live:
                if not entry.heartbeat.draining:
                    self._models.setdefault(entry.heartbeat.registration.model, entry.heartbeat.registration)
            self._models_counted = frozenset(e.heartbeat.registration.worker_id for e in live)
            # A node that goes stale takes its model with it; a heartbeat only moves its node's expiry later.
            self._models_valid = (now, min((e.seen_at for e in live), default=float("inf")))
        return self._models


HeartbeatListener = Callable[[Heartbeat], None]


class ClusterWatcher:
    def __init__(
        self,
        bus: Bus,
        state: ClusterState,
        view: ClusterView,
        resync_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bus = bus
        self._state = state
        self.view = view
        self._clock = clock
        self._resync = Periodic("cluster-resync", resync_interval_s, self._resync_and_prune)
        self._heartbeat_listeners: list[HeartbeatListener] = []

    def add_heartbeat_listener(self, listener: HeartbeatListener) -> None:
        """Call `listener` with each heartbeat heard on NATS, once the view holds it (not with those re-read from Redis)."""
        self._heartbeat_listeners.append(listener)

    async def start(self) -> None:
        # Recording one only updates memory: done as nats-py reads it, without a task and a loop iteration per heartbeat.
        await self._bus.subscribe(subjects.HEARTBEAT_ALL, HeartbeatMessage, self._on_heartbeat, traced=False, at_once=True)
        await self._bus.subscribe(subjects.WORKER_LEFT, WorkerLeft, self._on_left)
        await self.resync()
        self._resync.start()

    async def stop(self) -> None:
        await self._resync.stop()

    def _on_heartbeat(self, message: HeartbeatMessage, msg: Msg) -> None:
        self.heard(message)

    def heard(self, message: HeartbeatMessage) -> None:
        """Record a heartbeat (or load report) from NATS in the view, then hand it to the listeners."""
        heartbeat = self.view.assemble(message)
        if heartbeat is None:  # a load report whose registration the view learns later
            return
        self.view.observe(heartbeat, self._clock())
        for listener in self._heartbeat_listeners:
            listener(heartbeat)

    async def _on_left(self, event: WorkerLeft, msg: Msg) -> None:
        log.info("worker_left", worker_id=event.worker_id, reason=event.reason)
        self.view.remove(event.worker_id)

    async def resync(self) -> None:
        try:
            live = await self._state.live_heartbeats()
        except (redis.exceptions.RedisError, OSError) as exc:
            log.warning("redis_resync_failed", error=str(exc))
            return
        now = self._clock()
        for item in live:
            self.view.observe(item.heartbeat, now - item.age_s)

    async def _resync_and_prune(self) -> None:
        await self.resync()
        self.view.prune(self._clock())
