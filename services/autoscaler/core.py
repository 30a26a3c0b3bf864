"""Desired replicas per pool, from what clients saw and what nodes report (pure).

A pool is one base model's workers of one role (`PoolKey`): a fleet serving
two models has an aggregated pool of each, and one model's overload never
scales the other's workers. Latencies count for the base model that served
them, gauges for the model their node serves. Bounds are per role, and per model
where `[autoscaler.models]` names one.

Each signal becomes a pressure, observed over target (1.0: at target):

* aggregated: TTFT p99, TPOT p99, KV usage, requests waiting per replica;
* prefill: TTFT p99 while TPOT is within target (with TPOT over as well,
  the decode side is what to fix first), requests waiting per replica;
* decode: TPOT p99, KV usage, requests waiting per replica (the central
  queue waits for decode slots).

A pool's pressure is its worst signal. Two windows, as Knative's: the
stable window decides ordinary steps of `step`; a pressure at or over
`panic_threshold` in the short panic window scales up at once by
`panic_step` and holds off any scale-down for a stable window.

Pressure is taken to fall in proportion to replicas, so a change already
asked for counts before its replicas serve: with 2 replicas running and 4
asked for, a pressure of 1.6 is taken as 0.8 and nothing more is added
(an engine takes seconds to minutes to start; `up_cooldown_s` should cover
that, after which the replicas actually running count again). Scale-down is the
hysteresis: only when one replica fewer would still run under
`scale_down_pressure`, over a full stable window, and a cooldown after
every change.

A pool whose `min` is 0 goes to zero once nothing ran, waited or was
served for `idle_to_zero_s`, and leaves zero only when a balancer holds a
request for its model (`wake`): pressure cannot tell anything at zero, where
no node reports and no request is served. The registrations its workers
sent are remembered (`remember`), so that ingresses and balancers still take
the model's requests while no worker serves it (`from_zero`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from contracts.autoscaler import POOLS, Pool, PoolDecision, PoolKey
from contracts.messages import Heartbeat, WorkerRegistration
from shared.config import AutoscalerSettings


@dataclass(frozen=True)
class PoolGauges:
    """What a pool's nodes report at one moment."""

    replicas: int
    kv_usage: float  # mean over the pool's replicas, 0..1
    waiting: int  # requests waiting for the pool (its engines' queues, plus the central queue for slot-holding pools)
    running: int = 0  # requests its engines run

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0


# Pools whose nodes hold slots: requests in the central queue wait for one of them.
_SLOT_POOLS: tuple[Pool, ...] = ("aggregated", "decode")


def pool_gauges(heartbeats: list[Heartbeat], queued: Mapping[str, int]) -> dict[PoolKey, PoolGauges]:
    """Replicas, mean KV usage and waiting requests per pool, from the nodes that serve (draining ones leave).

    `queued`: requests in the central queue per model; under "" those a balancer did not count per model, which
    only a fleet of one model can tell whose they are.
    """
    by_pool: dict[PoolKey, list[Heartbeat]] = {}
    for heartbeat in heartbeats:
        if not heartbeat.draining:
            by_pool.setdefault(PoolKey(heartbeat.registration.model, heartbeat.registration.role), []).append(heartbeat)
    gauges = {}
    for pool, members in by_pool.items():
        usage = [hb.stats.kv_blocks_used / hb.stats.kv_blocks_total for hb in members if hb.stats.kv_blocks_total]
        gauges[pool] = PoolGauges(len(members), sum(usage) / len(usage) if usage else 0.0,
                                  sum(hb.stats.waiting for hb in members), sum(hb.stats.running for hb in members))
    models = {pool.model for pool in gauges}
    unattributed = queued.get("", 0) if len(models) == 1 else 0
    for model in models:
        waiting = queued.get(model, 0) + unattributed
        queued_for = next((key for role in _SLOT_POOLS if (key := PoolKey(model, role)) in gauges), None)
        if queued_for is not None and waiting:
            g = gauges[queued_for]
            gauges[queued_for] = PoolGauges(g.replicas, g.kv_usage, g.waiting + waiting, g.running)
    return gauges


@dataclass(frozen=True)
class Pressure:
    value: float
    signal: str


def _p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


class Observations:
    """Client latencies and pool gauges over time, kept as long as the stable window needs them."""

    def __init__(self, keep_s: float) -> None:
        self._keep_s = keep_s
        self._served: deque[tuple[float, str, float | None, float | None]] = deque()
        self._gauges: deque[tuple[float, Mapping[PoolKey, PoolGauges]]] = deque()
        # When each pool was first seen with replicas: a model that joins a running fleet has its own evidence to gather.
        self._first_seen_at: dict[PoolKey, float] = {}
        # Per model, kept apart from `_served`, which forgets: the idle window that takes a pool to zero may be longer.
        self._last_served_at: dict[str, float] = {}
        # Spans during which a pool had no replica, per pool (the end None while it has none still).
        self._without_replicas: dict[PoolKey, list[tuple[float, float | None]]] = {}

    def served(self, at: float, model: str, ttft_s: float | None, tpot_s: float | None, arrived_at: float | None = None) -> None:
        """A request for `model` answered at `at`; one that arrived while a pool of its model had no replica waited
        for a worker to start, a wait its TTFT would count as pressure (and scale a pool just woken from zero straight on)."""
        if ttft_s is not None and arrived_at is not None and self._without_a_replica(model, arrived_at):
            ttft_s = None
        self._served.append((at, model, ttft_s, tpot_s))
        self._last_served_at[model] = max(self.last_served_at(model), at)

    def last_served_at(self, model: str) -> float:
        return self._last_served_at.get(model, -math.inf)

    def replicas(self, pool: PoolKey, at: float, count: int) -> None:
        """How many replicas `pool` runs at `at` (only pools that may be at zero need saying)."""
        spans = self._without_replicas.setdefault(pool, [])
        still_none = bool(spans) and spans[-1][1] is None
        if count == 0 and not still_none:
            spans.append((at, None))
        elif count > 0 and still_none:
            spans[-1] = (spans[-1][0], at)

    def _without_a_replica(self, model: str, at: float) -> bool:
        return any(start <= at and (end is None or at < end) for pool, spans in self._without_replicas.items()
                   if pool.model == model for start, end in spans)

    def latest(self) -> Mapping[PoolKey, PoolGauges]:
        """The newest gauges (none before the first)."""
        return self._gauges[-1][1] if self._gauges else {}

    def gauges(self, at: float, pools: Mapping[PoolKey, PoolGauges]) -> None:
        self._gauges.append((at, dict(pools)))
        for pool in pools:
            self._first_seen_at.setdefault(pool, at)

    def forget_before(self, now: float) -> None:
        horizon = now - self._keep_s
        while self._served and self._served[0][0] < horizon:
            self._served.popleft()
        while self._gauges and self._gauges[0][0] < horizon:
            self._gauges.popleft()
        # A request served later may have arrived in a span that ended within the window, hardly before.
        for pool, spans in self._without_replicas.items():
            self._without_replicas[pool] = [(start, end) for start, end in spans if end is None or end >= horizon]

    def spans(self, pool: PoolKey, now: float, span_s: float) -> bool:
        """Whether `pool`'s gauges reach back over the whole span (a decision to scale it down needs that much evidence)."""
        return self._first_seen_at.get(pool, math.inf) <= now - span_s + 1e-9

    def pressures(self, now: float, span_s: float, settings: AutoscalerSettings, pools: Iterable[PoolKey],
                  latest_gauges: bool = False) -> dict[PoolKey, Pressure]:
        """Each pool's worst signal: its model's latency p99 over the span; gauges averaged over it, or the latest
        (a surge shows at once)."""
        since = now - span_s
        latencies: dict[str, tuple[list[float], list[float]]] = {}
        for at, model, ttft, tpot in self._served:
            if at >= since:
                ttfts, tpots = latencies.setdefault(model, ([], []))
                if ttft is not None:
                    ttfts.append(ttft)
                if tpot is not None:
                    tpots.append(tpot)
        samples = [gauges for at, gauges in self._gauges if at >= since and not latest_gauges]
        samples = samples or [gauges for _, gauges in list(self._gauges)[-1:]]
        pressures = {}
        for pool in pools:
            ttfts, tpots = latencies.get(pool.model, ([], []))
            ttft, tpot = _p99(ttfts), _p99(tpots)
            ttft_ratio = 0.0 if ttft is None else ttft / settings.ttft_p99_s
            tpot_ratio = 0.0 if tpot is None else tpot / settings.tpot_p99_s
            seen = [gauges[pool] for gauges in samples if pool in gauges and gauges[pool].replicas > 0]
            kv = sum(g.kv_usage for g in seen) / len(seen) / settings.kv_usage_max if seen else 0.0
            waiting = (sum(g.waiting / g.replicas for g in seen) / len(seen) / settings.waiting_per_replica_max) if seen else 0.0
            if pool.role == "aggregated":
                signals = {"ttft": ttft_ratio, "tpot": tpot_ratio, "kv_usage": kv, "waiting": waiting}
            elif pool.role == "prefill":
                signals = {"ttft": ttft_ratio if tpot_ratio <= 1.0 else 0.0, "waiting": waiting}
            else:
                signals = {"tpot": tpot_ratio, "kv_usage": kv, "waiting": waiting}
            worst = max(signals, key=signals.__getitem__)
            pressures[pool] = Pressure(signals[worst], worst)
        return pressures


class Autoscaler:
    """Decides each interval; remembers what it asked for, when, and whether a pool is in panic."""

    def __init__(self, settings: AutoscalerSettings) -> None:
        self._settings = settings
        self._asked: dict[PoolKey, int] = {}
        self._changed_at: dict[PoolKey, float] = {}
        self._panic_until: dict[PoolKey, float] = {}
        # When each pool was last active (running, waiting, served or woken), and when a request last waited for it
        # while it was at zero.
        self._active_at: dict[PoolKey, float] = {}
        self._woken_at: dict[PoolKey, float] = {}
        # The newest registration each pool's workers sent: how its model is served while at zero.
        self._registrations: dict[PoolKey, WorkerRegistration] = {}

    def remember(self, registrations: Iterable[WorkerRegistration]) -> None:
        """Registrations of workers seen now (or stored with an earlier decision); the newest per pool stays."""
        for registration in registrations:
            key = PoolKey(registration.model, registration.role)
            known = self._registrations.get(key)
            if known is None or registration.started_at >= known.started_at:
                self._registrations[key] = registration

    def _may_be_at_zero(self, pool: PoolKey) -> bool:
        return self._settings.bounds(pool.model, pool.role).min == 0

    def from_zero(self) -> list[WorkerRegistration]:
        """One registration per model of a pool that may scale to zero (its `min` is 0), generating pools' first."""
        chosen: dict[str, WorkerRegistration] = {}
        for pool, registration in sorted(self._registrations.items(), key=lambda item: _SERVES_FIRST[item[0].role]):
            if self._may_be_at_zero(pool):
                chosen.setdefault(pool.model, registration)
        return [chosen[model] for model in sorted(chosen)]

    def wake(self, now: float, model: str) -> list[Pool]:
        """A balancer holds a request for `model`, which no worker serves: its pools that may be at zero are wanted.

        Returns the roles of those pools (none: `model` has no such pool, and nothing changes); other models' pools
        stay as they are.
        """
        pools = sorted((pool for pool in self._registrations if pool.model == model and self._may_be_at_zero(pool)),
                       key=lambda pool: POOLS.index(pool.role))
        for pool in pools:
            self._woken_at[pool] = now
            self._active_at[pool] = now
        return [pool.role for pool in pools]

    def decide(self, now: float, observations: Observations, running: Mapping[PoolKey, int]) -> list[PoolDecision]:
        """Desired replicas of each pool that has replicas (a pool the fleet does not have is not managed)."""
        s = self._settings
        managed = self._managed(running)
        stable = observations.pressures(now, s.stable_window_s, s, managed)
        panic = observations.pressures(now, s.panic_window_s, s, managed, latest_gauges=True)
        latest = observations.latest()
        decisions = []
        for pool in managed:
            if self._may_be_at_zero(pool):
                observations.replicas(pool, now, running.get(pool, 0))
            # A request served for the model counts for each of its pools: the served events do not say which ran it.
            active = observations.last_served_at(pool.model)
            if pool in latest and latest[pool].busy:
                active = now
            self._active_at[pool] = max(self._active_at.get(pool, now), active)
            full_window = observations.spans(pool, now, s.stable_window_s)
            decisions.append(self._decide_pool(pool, now, running.get(pool, 0), stable[pool], panic[pool], full_window))
        return decisions

    def _managed(self, running: Mapping[PoolKey, int]) -> list[PoolKey]:
        """Pools with replicas or asked for, and pools that may be at zero whose workers were ever seen; by model,
        then role."""
        pools = {pool for pool, count in running.items() if count > 0}
        pools |= {pool for pool, asked in self._asked.items() if asked > 0}
        pools |= {pool for pool in self._registrations if self._may_be_at_zero(pool)}
        return sorted(pools, key=lambda pool: (pool.model, POOLS.index(pool.role)))

    def _decide_pool(self, pool: PoolKey, now: float, running: int, stable: Pressure, panic: Pressure, full_window: bool) -> PoolDecision:
        s = self._settings
        bounds = s.bounds(pool.model, pool.role)
        since_change = now - self._changed_at.get(pool, -math.inf)
        # A change asked for counts until its cooldown ends; by then replicas that
        # did not come (an actuator at its limit, a node that failed) are not waited for.
        asked = self._asked.get(pool, running) if since_change < s.up_cooldown_s else running
        # Pressure once what was asked for serves (pressure falls as replicas rise).
        scale = running / asked if asked > 0 and running > 0 else 1.0
        expected, expected_panic = stable.value * scale, panic.value * scale
        if panic.value >= s.panic_threshold:
            self._panic_until[pool] = now + s.stable_window_s
        in_panic = now < self._panic_until.get(pool, -math.inf)
        desired, reason = asked, "within target"
        if expected_panic >= s.panic_threshold:
            desired, reason = asked + s.panic_step, f"panic: {panic.signal} at {panic.value:.2f}x target"
        elif expected > 1.0:
            if since_change >= s.up_cooldown_s:
                desired, reason = asked + s.step, f"{stable.signal} at {stable.value:.2f}x target"
            else:
                reason = "over target, cooling down after the last change"
        elif asked > 1 and stable.value * running / (asked - 1) < s.scale_down_pressure:
            if in_panic:
                reason = "would scale down, but a panic is recent"
            elif not full_window:
                reason = "would scale down, once a full stable window is observed"
            elif since_change < s.down_cooldown_s:
                reason = "would scale down, cooling down after the last change"
            else:
                desired, reason = asked - s.step, f"{stable.signal} at {stable.value:.2f}x target with one replica fewer"
        if bounds.min == 0:
            desired, reason = self._to_or_from_zero(pool, now, asked, desired, reason, since_change, in_panic)
        bounded = max(bounds.min, min(bounds.max, desired))
        if bounded != desired:
            reason += f" (bounded to {bounds.min}..{bounds.max})"
        if bounded != asked:
            self._changed_at[pool] = now
        self._asked[pool] = bounded
        return PoolDecision(pool.role, running, bounded, round(stable.value, 4), round(panic.value, 4), stable.signal, reason,
                            in_panic, pool.model)

    def _to_or_from_zero(self, pool: PoolKey, now: float, asked: int, desired: int, reason: str, since_change: float,
                         in_panic: bool) -> tuple[int, str]:
        """`desired` for a pool that may be at zero: it leaves zero only for a request that waits, and goes there idle."""
        s = self._settings
        if asked == 0:
            # Woken since it was last changed: a wake before the pool went to zero was already counted as activity.
            if self._woken_at.get(pool, -math.inf) > self._changed_at.get(pool, -math.inf):
                return max(desired, 1), "a request waits for a worker, and the pool is at zero"
            return 0, "at zero until a request waits for a worker"
        idle_for = now - self._active_at.get(pool, now)
        if desired <= asked and idle_for >= s.idle_to_zero_s and not in_panic and since_change >= s.down_cooldown_s:
            return 0, f"idle for {idle_for:.0f}s (idle_to_zero_s {s.idle_to_zero_s:g})"
        return desired, reason


# The registration a model is served as from zero: a generating node's (what ingress reads of it is the same on
# every role, but a prefill node's says less of the decode it does not run).
_SERVES_FIRST: dict[Pool, int] = {"aggregated": 0, "decode": 1, "prefill": 2}
