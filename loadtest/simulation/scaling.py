"""The autoscaler in virtual time: its real core (`services.autoscaler.core`) deciding on the simulated fleet.

Each interval it reads what the live service reads (the balancer's view of
the heartbeats, the central queue, the latencies clients saw), decides,
and acts as `kvlane up --autoscale` does: a new node of the pool's kind
joins, or the pool's newest node drains (takes nothing new, finishes what
it runs, then leaves). Nodes take `start_s` to come up, as an engine does.
The simulated fleet serves one model, so its pools are that model's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from contracts.autoscaler import PoolDecision
from contracts.messages import WorkerRole
from launch.fleet_mix import FleetNode
from loadtest.bench.client import RequestRecord
from loadtest.simulation.events import EventQueue
from loadtest.simulation.node import SimNode
from services.autoscaler.core import Autoscaler, Observations, pool_gauges
from shared.cluster import ClusterView
from shared.config import AutoscalerSettings
from shared.genai import time_per_output_token

_ID_PREFIX = {"aggregated": "w", "prefill": "p", "decode": "d"}


@dataclass
class ScalingTimeline:
    """Serving nodes per pool after each decision, and node-seconds held (what the fleet cost)."""

    points: list[tuple[float, str, int, int]] = field(default_factory=list)  # (client time, pool, serving, desired)
    node_seconds: float = 0.0


class SimScaler:
    def __init__(
        self,
        settings: AutoscalerSettings,
        events: EventQueue,
        nodes: dict[str, SimNode],
        kinds: dict[WorkerRole, FleetNode],
        view: ClusterView,
        queue_length: Callable[[], int],
        add_node: Callable[[str, str, float, WorkerRole], None],
        client_time: Callable[[], float],
        start_s: float,
        model: str,
    ) -> None:
        self._settings = settings
        self._events = events
        self._nodes = nodes
        self._kinds = kinds
        self._view = view
        self._queue_length = queue_length
        self._add_node = add_node
        self._client_time = client_time
        self._start_s = start_s
        self._model = model
        self._core = Autoscaler(settings)
        self._observations = Observations(settings.stable_window_s)
        self._counts = {pool: sum(1 for n in nodes.values() if n.registration.role == pool) for pool in _ID_PREFIX}
        self._joining: dict[str, int] = {pool: 0 for pool in _ID_PREFIX}
        self._last_at = events.now
        self.timeline = ScalingTimeline()

    def start(self) -> None:
        self._events.after(self._settings.interval_s, self._decide)

    def served(self, record: RequestRecord) -> None:
        if record.first_token_s is None or record.end_s is None:
            return
        ttft = record.first_token_s - record.sent_s
        tpot = time_per_output_token(record.end_s - record.sent_s, ttft, record.completion_tokens or 0)
        self._observations.served(self._events.now, self._model, ttft, tpot)

    def _serving(self, pool: str) -> list[SimNode]:
        return [n for n in self._nodes.values() if n.alive and not n.draining and n.registration.role == pool
                and n.registration.model == self._model]

    def _decide(self) -> None:
        now = self._events.now
        self._account(now)
        gauges = pool_gauges(self._view.live(now), {self._model: self._queue_length()})
        self._observations.gauges(now, gauges)
        self._observations.forget_before(now)
        running = {pool: g.replicas for pool, g in gauges.items()}
        for decision in self._core.decide(now, self._observations, running):
            self._apply(decision)
        self._events.after(self._settings.interval_s, self._decide)

    def _apply(self, decision: PoolDecision) -> None:
        pool = decision.pool
        serving = self._serving(pool)
        have = len(serving) + self._joining[pool]
        for _ in range(decision.desired - have):
            worker_id = f"{_ID_PREFIX[pool]}{self._counts[pool]}"
            self._counts[pool] += 1
            self._joining[pool] += 1
            self._events.after(self._start_s, self._join, worker_id, pool)
        for node in sorted(serving, key=lambda n: n.registration.started_at)[::-1][: max(0, have - decision.desired)]:
            node.draining = True
            self._events.after(self._settings.interval_s, self._retire_when_idle, node)
        self.timeline.points.append((self._client_time(), pool, len(self._serving(pool)), decision.desired))

    def _join(self, worker_id: str, pool: WorkerRole) -> None:
        self._joining[pool] -= 1
        kind = self._kinds[pool]
        self._add_node(worker_id, kind.profile, kind.speed, pool)

    def _retire_when_idle(self, node: SimNode) -> None:
        if node.scheduler.has_work():
            self._events.after(1.0, self._retire_when_idle, node)
            return
        node.alive = False  # it beats no more: the balancer forgets it after the heartbeat TTL

    def finish(self) -> None:
        self._account(self._events.now)

    def _account(self, now: float) -> None:
        alive = sum(1 for n in self._nodes.values() if n.alive)
        self.timeline.node_seconds += alive * (now - self._last_at)
        self._last_at = now
