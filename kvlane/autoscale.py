"""`kvlane up --autoscale`: the autoscaler's decisions applied to the local fleet.

The autoscaler service decides; this actuator only makes the fleet match
the latest decision it stored in Redis: it starts workers a pool lacks and
drains the pool's newest workers when it has too many (SIGTERM: a worker
finishes what it runs, takes nothing new, then exits). What a Kubernetes
HPA or KEDA does with `kvlane_autoscaler_desired_replicas`, on one machine.
A pool decided down to 0 loses its last worker, and a decision of 1 for it
(a balancer holds a request for its model) starts one again.

Pools are per base model. `kvlane up` starts workers of one model, the
configured one (`worker.served_model`), so only that model's pools are
acted on here; a pool of another model, whose workers something else
started, is reported once and left to whatever started them.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from contracts.autoscaler import ScalingDecision
from launch.fleet import Fleet
from launch.launcher import Process

_ID_PREFIX = {"aggregated": "w", "prefill": "p", "decode": "d"}


class FleetActuator:
    def __init__(self, fleet: Fleet, read_decision: Callable[[], bytes | None], report: Callable[[str], None]) -> None:
        self._fleet = fleet
        self._read = read_decision
        self._report = report
        self.model = fleet.config.worker.served_model
        self._draining: list[Process] = []
        self._started = {pool: sum(1 for role in fleet.roles.values() if role == pool) for pool in _ID_PREFIX}
        self._not_started_here: set[str] = set()

    def members(self, pool: str) -> list[Process]:
        return [p for p in self._fleet.workers if self._fleet.roles[p.name] == pool]

    def step(self) -> list[str]:
        """Apply the latest decision, if any; returns what changed (idempotent: a decision already applied changes nothing)."""
        raw = self._read()
        if raw is None:
            return []
        decision = msgspec.json.decode(raw, type=ScalingDecision)
        changes = []
        for (model, pool), desired in decision.desired().items():
            # "": a decision from an autoscaler that knew one model only, this fleet's.
            if model not in (self.model, ""):
                self._left_alone(model)
                continue
            members = self.members(pool)
            for _ in range(desired - len(members)):
                worker_id = f"{_ID_PREFIX[pool]}{self._started[pool]}"
                self._started[pool] += 1
                self._fleet.add_worker(worker_id, pool)
                changes.append(f"started {pool} worker {worker_id}")
            for process in reversed(members[desired:] if desired < len(members) else []):
                self._fleet.drain_worker(process)
                self._draining.append(process)
                changes.append(f"draining {process.name}")
        for change in changes:
            self._report(change)
        self._draining = [p for p in self._draining if p.alive()]
        return changes

    def _left_alone(self, model: str) -> None:
        if model not in self._not_started_here:
            self._not_started_here.add(model)
            self._report(f"model {model!r}: its pools are not scaled here (kvlane up starts workers of {self.model!r} only)")

    @property
    def draining(self) -> list[Process]:
        return list(self._draining)
