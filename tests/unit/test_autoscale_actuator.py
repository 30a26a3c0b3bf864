"""`kvlane up --autoscale`'s actuator: it scales the pools of the model its fleet starts workers of, and only those."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from contracts.autoscaler import PoolDecision, ScalingDecision
from kvlane.autoscale import FleetActuator
from shared.config import KvlaneConfig, WorkerSettings


@dataclass
class Worker:
    name: str
    running: bool = True

    def alive(self) -> bool:
        return self.running


@dataclass
class FakeFleet:
    """What the actuator uses of `launch.fleet.Fleet`: its config, workers and roles; starting and draining one."""

    config: KvlaneConfig
    workers: list[Worker] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    drained: list[str] = field(default_factory=list)

    def add_worker(self, worker_id: str, role: str = "aggregated") -> Worker:
        worker = Worker(f"worker-{worker_id}")
        self.workers.append(worker)
        self.roles[worker.name] = role
        return worker

    def drain_worker(self, worker: Worker) -> None:
        self.workers.remove(worker)
        self.drained.append(worker.name)


def actuator_of(model: str = "kvlane-sim") -> tuple[FleetActuator, FakeFleet, list[bytes | None], list[str]]:
    fleet = FakeFleet(KvlaneConfig(worker=WorkerSettings(model=model)))
    fleet.add_worker("w0")
    stored: list[bytes | None] = [None]
    reports: list[str] = []
    return FleetActuator(fleet, lambda: stored[0], reports.append), fleet, stored, reports  # type: ignore[arg-type]


def decision(*pools: tuple[str, str, int]) -> bytes:
    return msgspec.json.encode(ScalingDecision("a", 1.0, [
        PoolDecision(role, 1, desired, 1.0, 1.0, "ttft", "", False, model) for model, role, desired in pools]))


def test_only_the_fleet_s_model_is_scaled_and_another_model_is_reported_once() -> None:
    actuator, fleet, stored, reports = actuator_of()
    stored[0] = decision(("kvlane-sim", "aggregated", 3), ("other", "aggregated", 5), ("other", "decode", 2))
    assert actuator.step() == ["started aggregated worker w1", "started aggregated worker w2"]
    assert [w.name for w in fleet.workers] == ["worker-w0", "worker-w1", "worker-w2"]
    assert [r for r in reports if "other" in r] == [
        "model 'other': its pools are not scaled here (kvlane up starts workers of 'kvlane-sim' only)"]
    assert actuator.step() == [] and len(reports) == 3  # applied already; nothing reported again
    stored[0] = decision(("kvlane-sim", "aggregated", 1), ("other", "aggregated", 0))
    assert actuator.step() == ["draining worker-w2", "draining worker-w1"]
    assert fleet.drained == ["worker-w2", "worker-w1"]


def test_a_decision_without_models_is_the_fleet_s() -> None:
    actuator, fleet, stored, _ = actuator_of()
    stored[0] = decision(("", "aggregated", 2))
    assert actuator.step() == ["started aggregated worker w1"]


def test_a_vllm_fleet_s_model_is_the_name_it_serves_under() -> None:
    config = KvlaneConfig(worker=msgspec.convert({"engine": "vllm", "model": "tiny", "vllm": {"served_model_name": "tiny-chat"}},
                                                 WorkerSettings))
    fleet = FakeFleet(config)
    actuator = FleetActuator(fleet, lambda: decision(("tiny-chat", "aggregated", 1), ("tiny", "aggregated", 4)), lambda _: None)  # type: ignore[arg-type]
    assert actuator.model == "tiny-chat" and actuator.step() == ["started aggregated worker w0"]
