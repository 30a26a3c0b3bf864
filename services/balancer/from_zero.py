"""Requests for a model whose pool is at zero (pure): held, not refused, and the autoscaler woken.

A model may be served from zero when the autoscaler says so (its pool's
`min` is 0: `ScalingDecision.from_zero`). While no worker serves it, a
request for it waits in the central queue, like one that waits for a slot,
and the balancer asks the autoscaler for a worker (`WakeAutoscaler`, carried
out as `ScaleUpWanted` on NATS): at once for the first such request, then
again every `wake_every_s` while any waits, so that a wake lost on the bus,
or sent before the autoscaler started, costs one interval. The queue drains
on the first heartbeat of the new worker, as on any freed slot; a request
still waiting at its deadline is refused with a 503 that says no worker
started in time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Container, Sequence

from msgspec import Struct

from contracts.messages import Heartbeat
from services.balancer.central_queue import CentralQueue, QueuedRequest


class WakeAutoscaler(Struct, gc=False):
    """Ask the autoscaler for a worker of `model`: `held` requests wait for one. Nothing to report."""

    model: str
    held: int


class FromZero:
    """`models`: those served from zero (any container of names; the service's follows the autoscaler's decisions)."""

    def __init__(self, models: Container[str] = frozenset(), wake_every_s: float = 1.0) -> None:
        if not wake_every_s > 0:
            raise ValueError(f"wake_every_s must be positive, not {wake_every_s}")
        self.models = models
        self._wake_every_s = wake_every_s
        self._woken_at: dict[str, float] = {}

    def holds(self, model: str, routable: Sequence[Heartbeat]) -> bool:
        """Whether a request for `model` waits for a worker to start: none can take it, and its pool scales from zero."""
        return not routable and model in self.models

    def held(self, model: str, now: float, held: Callable[[], int]) -> WakeAutoscaler | None:
        """A request for `model` was just held (`held()`: how many wait in all): the wake to send, unless one went
        out lately (counting them walks the queue: only then)."""
        if now - self._woken_at.get(model, -math.inf) < self._wake_every_s:
            return None
        self._woken_at[model] = now
        return WakeAutoscaler(model, held())

    def waiting(self, queue: CentralQueue, routable: Callable[[str], Sequence[Heartbeat]]) -> Counter[str]:
        """Requests waiting per model that no worker serves now, of the models served from zero."""
        held: Counter[str] = Counter()
        serving: dict[str, bool] = {}
        for entry in queue.in_order():
            model = entry.request.model
            if model not in self.models:
                continue
            if model not in serving:
                serving[model] = bool(routable(model))
            if not serving[model]:
                held[model] += 1
        return held

    def due(self, now: float, held: Counter[str]) -> list[WakeAutoscaler]:
        """The wakes to send again for models whose requests still wait (`waiting`); forgets models none waits for."""
        self._woken_at = {model: at for model, at in self._woken_at.items() if held[model]}
        return [wake for model, count in sorted(held.items()) if (wake := self.held(model, now, lambda: count)) is not None]

    def timed_out(self, entry: QueuedRequest, routable: Sequence[Heartbeat]) -> str | None:
        """Why `entry` is refused at its deadline when it waited for a worker to start (None: it waited for a slot)."""
        model = entry.request.model
        if not self.holds(model, routable):
            return None
        return (f"no worker of model {model!r} started within {entry.deadline - entry.enqueued_at:.1f}s "
                "(its pool scales from zero and is starting one); retry later")
