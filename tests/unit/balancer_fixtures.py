"""Hand-built heartbeats, snapshots and routers for the balancer's unit tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from contracts.messages import EngineStats, Heartbeat, RouteRequest, WorkerRegistration
from services.balancer.central_queue import CentralQueue
from services.balancer.policies import make_policy
from services.balancer.prefix_pull import PrefixPulls
from services.balancer.router import Router
from services.balancer.slot_table import SlotTable
from services.balancer.snapshot import ChainState, ClusterSnapshot, NodeFacts, SnapshotBuilder
from services.balancer.speed import StepModel
from services.balancer.trackers import QueueGrowth, SpeedTracker
from shared.balancer_settings import PrefixPullSettings
from shared.config import BalancerSettings, DegradationSettings, JffcPerRequestSettings, QueueSettings, SlotSettings
from shared.kv.prefix_index import PrefixIndex

NOW_WALL = 1_700_000_000.0
TINY = StepModel(a=2e-3, b=2e-5, c=2e-4, d=0.0)


def heartbeat(
    worker_id: str,
    *,
    model: str = "m",
    draining: bool = False,
    running: int = 0,
    waiting: int = 0,
    used: int = 0,
    blocks: int = 4096,
    sent_at: float = NOW_WALL,
    decode_tps: float = 0.0,
    prefill_tps: float = 0.0,
    started_at: float = 0.0,
    role: str = "aggregated",
) -> Heartbeat:
    registration = WorkerRegistration(
        worker_id=worker_id, role=role, model=model, engine="sim", inbox=f"inbox.{worker_id}", block_size=16,  # type: ignore[arg-type]
        max_model_len=4096, tokenizer="sim", started_at=started_at,
    )
    stats = EngineStats(
        running=running, waiting=waiting, kv_blocks_total=blocks, kv_blocks_used=used,
        decode_tokens_per_s=decode_tps, prefill_tokens_per_s=prefill_tps,
    )
    return Heartbeat(registration=registration, stats=stats, sent_at=sent_at, seq=1, draining=draining)


def node(
    worker_id: str,
    *,
    running: int = 0,
    waiting: int = 0,
    slots: int = 8,
    speed: float = 1.0,
    health: float = 1.0,
    kv_used: int = 0,
    kv_total: int = 1000,
    growth: float = 0.0,
    gpu: float | None = None,
    role: str = "aggregated",
) -> NodeFacts:
    return NodeFacts(
        worker_id=worker_id, role=role, chain_id=f"{worker_id}@0", inbox=f"inbox.{worker_id}", block_size=16, running=running,
        waiting=waiting, kv_blocks_total=kv_total, kv_blocks_used=kv_used, gpu_utilization=gpu, slots_total=slots,
        model=TINY.scaled(speed), speed=speed, speed_measured=True, health_weight=health, queue_growth_per_s=growth / 2.0, growth_penalty=growth,
        sent_at=NOW_WALL,
    )


def chain(worker_id: str, *, used: int = 0, cached: int = 0, **facts: object) -> ChainState:
    return ChainState(node(worker_id, **facts), used, cached)  # type: ignore[arg-type]


def snapshot(*chains: ChainState, request_blocks: int = 0) -> ClusterSnapshot:
    return ClusterSnapshot(tuple(chains), request_blocks)


def request(
    request_id: str = "r1", *, prompt: int = 64, output: int = 16, blocks: int = 4, priority: int = 0,
    timeout_s: float = 60.0, exclude: list[str] | None = None, model: str = "m",
) -> RouteRequest:
    return RouteRequest(
        request_id=request_id, model=model, prompt_tokens=prompt, max_tokens=output, timeout_s=timeout_s,
        block_hashes=list(range(1000, 1000 + blocks)), priority=priority, exclude_workers=exclude or [],
    )


def settings(policy: str = "jffc_per_request", **slots: object) -> BalancerSettings:
    return BalancerSettings(policy=policy, slots=SlotSettings(**slots))  # type: ignore[arg-type]


def router(policy: str = "jffc_per_request", queue_length: int = 64, queue: QueueSettings | None = None,
           jffc: JffcPerRequestSettings | None = None, clock: Callable[[], float] = time.time, use_index: bool = True,
           degradation: DegradationSettings | None = None, prefix_pull: PrefixPullSettings | None = None,
           **slots: object) -> Router:
    s = settings(policy, **slots)
    if jffc is not None:
        s = msgspec.structs.replace(s, jffc_per_request=jffc)
    builder = SnapshotBuilder(s, SpeedTracker(TINY, s.speed.smoothing, s.speed.equal_within), QueueGrowth(s.speed.smoothing),
                              clock=clock)
    return Router(make_policy(policy, s), builder, PrefixIndex(), SlotTable(), CentralQueue(queue_length), queue or s.queue,
                  degradation=degradation, use_index=use_index,
                  pulls=None if prefix_pull is None else PrefixPulls(prefix_pull, s.jffc_per_request.imposed_delay_weight))
