"""What the balancer learns from successive heartbeats (pure, no I/O).

* `QueueGrowth`: how fast each node's waiting queue grows, so a node whose
  queue is filling is penalised before the queue is long.
* `SpeedTracker`: each node's speed relative to its step-time model (the
  one it advertises, else the fallback profile), from measured token rates. Throughput alone is not speed (an idle
  node measures 0 tok/s), so only intervals during which the node was busy
  count (running at this heartbeat AND the previous one: a node that was
  idle for part of the interval would look slow, and then get less work,
  and look slower still): the observed time per decode step is then
  `running / decode_tok_s`, and the profile predicts it for the same batch
  and prefill share. Identical nodes still measure differently (their
  batch and prefill/decode mix differ, and the fallback profile's shape is
  not the engine's), so speeds within `equal_within` of a tier's median
  are reported as that one speed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

from contracts.messages import Heartbeat, WorkerRegistration
from services.balancer.speed import StepModel


class QueueGrowth:
    def __init__(self, smoothing: float) -> None:
        self._smoothing = smoothing
        self._last: dict[str, tuple[float, int]] = {}
        self._rate: dict[str, float] = {}

    def observe(self, worker_id: str, sent_at: float, waiting: int) -> None:
        last = self._last.get(worker_id)
        if last is not None and sent_at <= last[0]:
            return  # a repeat or reordered heartbeat says nothing new
        self._last[worker_id] = (sent_at, waiting)
        if last is None:
            return
        rate = (waiting - last[1]) / (sent_at - last[0])
        previous = self._rate.get(worker_id, 0.0)
        self._rate[worker_id] = previous + self._smoothing * (rate - previous)

    def rate(self, worker_id: str) -> float:
        """Smoothed d(waiting)/dt in requests per second (negative when the queue shrinks)."""
        return self._rate.get(worker_id, 0.0)

    def forget(self, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            self._last.pop(worker_id, None)
            self._rate.pop(worker_id, None)


class SpeedTracker:
    def __init__(self, model: StepModel, smoothing: float, equal_within: float = 0.0) -> None:
        self.model = model  # the fallback, for nodes that advertise no step time
        self._smoothing = smoothing
        self._equal_within = equal_within
        self._factor: dict[str, float] = {}
        # (factor, worker) of every measured node, slowest first: kept in order as measurements come, since
        # sorting the fleet at every heartbeat would cost more than the rest of the heartbeat.
        self._ordered: list[tuple[float, str]] = []
        self._seen: dict[str, float] = {}
        self._was_busy: set[str] = set()
        self._tiers: tuple[dict[str, float], float] | None = None  # (tiered factors, median); None: recompute

    def observe(self, heartbeat: Heartbeat) -> None:
        worker_id, stats = heartbeat.registration.worker_id, heartbeat.stats
        if self._seen.get(worker_id) == heartbeat.sent_at:
            return
        self._seen[worker_id] = heartbeat.sent_at
        model = self.model_for(heartbeat.registration)
        busy_throughout = worker_id in self._was_busy
        if stats.running > 0:
            self._was_busy.add(worker_id)
        else:
            self._was_busy.discard(worker_id)
            self._relax_idle(worker_id)
        if not busy_throughout or stats.running == 0 or stats.decode_tokens_per_s <= 0:
            return
        steps_per_s = stats.decode_tokens_per_s / stats.running
        kv_tokens = stats.kv_blocks_used * heartbeat.registration.block_size
        predicted_busy = model.busy_seconds(steps_per_s, stats.prefill_tokens_per_s, stats.running, kv_tokens)
        if predicted_busy <= 0:
            return
        # Busy nodes step back to back: one second of wall time held
        # `predicted_busy` seconds of work as the node's model prices it.
        factor = predicted_busy
        previous = self._factor.get(worker_id)
        self._set_factor(worker_id, factor if previous is None else previous + self._smoothing * (factor - previous))

    def _set_factor(self, worker_id: str, factor: float) -> None:
        previous = self._factor.get(worker_id)
        if previous == factor:
            return
        if previous is not None:
            self._unorder(worker_id, previous)
        self._factor[worker_id] = factor
        bisect.insort(self._ordered, (factor, worker_id))
        self._tiers = None

    def _unorder(self, worker_id: str, factor: float) -> None:
        entry = (factor, worker_id)
        at = bisect.bisect_left(self._ordered, entry)
        if at < len(self._ordered) and self._ordered[at] == entry:
            del self._ordered[at]
        else:  # a NaN measurement sorts nowhere in particular
            self._ordered.remove(entry)

    def _median(self) -> float:
        return self._ordered[len(self._ordered) // 2][0] if self._ordered else 1.0

    def _relax_idle(self, worker_id: str) -> None:
        """An idle node's estimate drifts back toward the fleet's median.

        Speed is measured only while a node works; a node once measured slow
        (a passing fault) would otherwise stay ranked last for ever, get no
        work, and never be measured again.
        """
        previous = self._factor.get(worker_id)
        if previous is None or len(self._factor) < 2:
            return
        median = self._median()
        self._set_factor(worker_id, previous + self._smoothing * (median - previous))

    def model_for(self, registration: WorkerRegistration) -> StepModel:
        """The node's own step time when it advertises one, else the fallback profile's."""
        return StepModel.of(registration.step_time) if registration.step_time is not None else self.model

    def measured(self, worker_id: str) -> float | None:
        """The node's own smoothed measurement, None until measured."""
        return self._factor.get(worker_id)

    def factor(self, worker_id: str) -> float | None:
        """Speed relative to the node's model (2.0 = twice as fast), None until measured.

        Nodes whose measurements are within `equal_within` of each other
        share one speed (their median), so policies that rank by speed treat
        them as equals instead of ranking on measurement noise.
        """
        if worker_id not in self._factor:
            return None
        return self._tiered()[0][worker_id]

    def typical_factor(self) -> float:
        """What an unmeasured node is assumed to be: the median measured node, else the profile."""
        return self._median()

    def _tiered(self) -> tuple[dict[str, float], float]:
        # Recomputed once per new measurement, not per routing decision.
        if self._tiers is None:
            self._tiers = (_tiers_of_sorted(self._ordered, self._equal_within), self._median())
        return self._tiers

    def forget(self, worker_ids: Iterable[str]) -> None:
        for worker_id in worker_ids:
            factor = self._factor.pop(worker_id, None)
            if factor is not None:
                self._unorder(worker_id, factor)
            self._seen.pop(worker_id, None)
            self._was_busy.discard(worker_id)
        self._tiers = None


def speed_tiers(factors: Mapping[str, float], equal_within: float) -> dict[str, float]:
    """Each node's speed, with speeds within `equal_within` (relative) of a tier's median replaced by that median.

    The first tier is centred on the fleet's median speed and takes every
    node within [median / (1 + equal_within), median * (1 + equal_within)];
    the nodes left form the next tiers the same way. Centring on the median
    (rather than chaining neighbours) keeps a homogeneous fleet in one tier
    even when its measurements spread across a tier's width, so no part of
    it is ranked above the rest on noise. Tiers depend only on the set of
    measurements: every replica computes the same ones.
    """
    return _tiers_of_sorted(_by_factor(factors), equal_within)


def _by_factor(factors: Mapping[str, float]) -> list[tuple[float, str]]:
    """(factor, worker) pairs, slowest first (ties by worker id)."""
    return sorted(zip(factors.values(), factors.keys()))


def _tiers_of_sorted(ordered: list[tuple[float, str]], equal_within: float) -> dict[str, float]:
    """`speed_tiers` of `_by_factor`'s pairs. A tier is a run of neighbours in that order, and what is left
    after taking one is still sorted: each tier costs two bisections, not a pass over the fleet (heartbeats
    change measurements, and so the tiers, hundreds of times a second)."""
    if equal_within <= 0:
        return {worker_id: factor for factor, worker_id in ordered}
    values = [factor for factor, _ in ordered]
    workers = [worker_id for _, worker_id in ordered]
    tiers: dict[str, float] = {}
    while values:
        median = values[len(values) // 2]
        start = bisect.bisect_left(values, median / (1 + equal_within))
        end = bisect.bisect_right(values, median * (1 + equal_within))
        tiers.update(dict.fromkeys(workers[start:end], median))
        values, workers = values[:start] + values[end:], workers[:start] + workers[end:]
    return tiers


class ArrivalRate:
    """Route requests per second, as a moving average over ticks."""

    def __init__(self, smoothing: float, started_at: float) -> None:
        self._smoothing = smoothing
        self._count = 0
        self._since = started_at
        self.per_second = 0.0

    def arrived(self) -> None:
        self._count += 1

    def tick(self, now: float) -> float:
        elapsed = now - self._since
        if elapsed <= 0:
            return self.per_second
        rate = self._count / elapsed
        self.per_second += self._smoothing * (rate - self.per_second)
        self._count, self._since = 0, now
        return self.per_second
