"""The balancer's routing core built from settings: shared by the service, the simulator and the benchmarks."""

from __future__ import annotations

from services.balancer.adapters import AdapterPlacement
from services.balancer.central_queue import CentralQueue
from services.balancer.policies import make_policy
from services.balancer.prefix_pull import PrefixPulls
from services.balancer.router import Router
from services.balancer.slot_table import SlotTable
from services.balancer.snapshot import SnapshotBuilder
from services.balancer.speed import StepModel
from services.balancer.trackers import QueueGrowth, SpeedTracker
from shared.config import BalancerSettings
from shared.kv.prefix_index import PrefixIndex
from shared.kv.step_profile import get_profile


def fallback_step_model(profile_name: str) -> StepModel:
    """The named sim profile's coefficients: what a node is assumed to do before it is measured."""
    try:
        profile = get_profile(profile_name)
    except KeyError as exc:
        raise SystemExit(f"balancer.speed.fallback_profile: {exc.args[0]}") from None
    return StepModel(a=profile.a, b=profile.b, c=profile.c, d=profile.d, per_request=profile.per_request)


def build_router(settings: BalancerSettings, model: StepModel, use_index: bool = True) -> Router:
    """The routing core; `use_index=False` decides on a fresh snapshot per request (benchmarks compare the two)."""
    speed = SpeedTracker(model, settings.speed.smoothing, settings.speed.equal_within)
    builder = SnapshotBuilder(settings, speed, QueueGrowth(settings.speed.smoothing))
    return Router(
        make_policy(settings.policy, settings),
        builder,
        PrefixIndex(settings.prefix_index_max_blocks),
        SlotTable(),
        CentralQueue(settings.queue.max_length),
        settings.queue,
        settings.disaggregation,
        settings.degradation,
        use_index=use_index,
        adapters=AdapterPlacement(settings.adapters),
        pulls=PrefixPulls(settings.prefix_pull, settings.jffc_per_request.imposed_delay_weight),
    )
