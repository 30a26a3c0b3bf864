"""`kvlane up --autoscale`: the autoscaler's decisions applied to the local fleet.

The autoscaler service decides; this actuator only makes the fleet match
the latest decision it stored in Redis: it starts workers a pool lacks and
drains the pool's newest workers when it has too many (SIGTERM: a worker
finishes what it runs, takes nothing new, then exits). What a Kubernetes
HPA or KEDA does with `kvlane_autoscaler_desired_replicas`, on one machine.
A pool decided down to 0 loses its last worker, and a decision of 1 for it
(a balancer holds a request for its model) starts one again.
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
        self._draining: list[Process] = []
        self._started = {pool: sum(1 for role in fleet.roles.values() if role == pool) for pool in _ID_PREFIX}

    def members(self, pool: str) -> list[Process]:
        return [p for p in self._fleet.workers if self._fleet.roles[p.name] == pool]

    def step(self) -> list[str]:
        """Apply the latest decision, if any; returns what changed (idempotent: a decision already applied changes nothing)."""
        raw = self._read()
        if raw is None:
            return []
        decision = msgspec.json.decode(raw, type=ScalingDecision)
        changes = []
        for pool, desired in decision.desired().items():
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

    @property
    def draining(self) -> list[Process]:
        return list(self._draining)
