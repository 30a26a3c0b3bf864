"""GPU-free sim engine core: continuous batching over paged, prefix-cached KV blocks.

Pure synchronous code; the worker's async shell drives ``SimScheduler.step``
and sleeps for the simulated step time it returns.
"""

from services.worker.sim.blocks import BlockPool, KvCacheEvent
from shared.kv.step_profile import NAMED_PROFILES, StepTimeProfile, get_profile
from services.worker.sim.scheduler import (
    FinishedInfo,
    SchedulerStats,
    SimRequest,
    SimScheduler,
    StepOutcome,
)
from services.worker.sim.tokens import output_token, prompt_digest

__all__ = [
    "NAMED_PROFILES",
    "BlockPool",
    "FinishedInfo",
    "KvCacheEvent",
    "SchedulerStats",
    "SimRequest",
    "SimScheduler",
    "StepOutcome",
    "StepTimeProfile",
    "get_profile",
    "output_token",
    "prompt_digest",
]
