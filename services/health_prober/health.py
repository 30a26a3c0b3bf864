"""Per-node health with hysteresis (pure core, no I/O).

healthy → suspect: `bad_probes_to_suspect` bad probes in a row (failed, or
far slower than the node's own baseline), or many client complaints in
the feedback window. suspect → unhealthy: the bad probes go on to
`bad_probes_to_unhealthy`. Back to healthy only after
`good_probes_to_recover` good probes in a row with complaints below the
threshold: one lucky probe does not flip a sick node back.

The baseline is an exponential average of good probe latencies, learnt
only while the node is healthy, so a slowly degrading node cannot drag its
own baseline up with it.

A node that restarted (a new `started_at` under the same id) is a new
process: it starts healthy, with no baseline and no streak, and complaints
about the process before it do not count: those that name that process,
and, of those that name none, the ones heard before the new one started.
Without that, the complaints of every stream the crash broke (each one a
"timeout") kept the restarted node suspect for the whole feedback window.

Busy is not sick: a probe that was slow or timed out while the node
reported requests waiting measured the node's queue (a prefill node under
load always has one), so it counts neither way. A probe the node refused
or never accepted still counts as bad.
"""

from __future__ import annotations

import math
from collections import deque

from contracts.health import FeedbackKind, HealthState, HealthVerdict
from shared.config import HealthSettings

_BASELINE_ALPHA = 0.2


class NodeHealth:
    def __init__(self, worker_id: str, settings: HealthSettings, now: float) -> None:
        self.worker_id = worker_id
        self._settings = settings
        self.state: HealthState = "healthy"
        self.since = now
        self.reason = "no probe yet"
        self.baseline: float | None = None
        self.last_latency: float | None = None
        self._bad_streak = 0
        self._good_streak = 0
        # (heard at, kind, the start of the process complained about or 0 when the complaint did not say)
        self._feedback: deque[tuple[float, FeedbackKind, float]] = deque()
        # When the process this state is about started (its registration's `started_at`); None until a probe round saw it.
        self.started_at: float | None = None

    def started(self, started_at: float, now: float) -> bool:
        """The node's process started at `started_at`; True when that is a new one and what was known was forgotten.

        Complaints that name another process, or name none and were heard
        before `started_at`, were about an earlier one; so are the probe streak,
        baseline and state when an earlier start was known.
        """
        if started_at == self.started_at:
            return False
        restarted = self.started_at is not None
        self.started_at = started_at
        about_it = deque(complaint for complaint in self._feedback
                         if complaint[2] == started_at or (not complaint[2] and complaint[0] >= started_at))
        if not restarted and len(about_it) == len(self._feedback):
            return False
        self._feedback = about_it
        self.state, self.since, self.reason = "healthy", now, "restarted"
        self.baseline = self.last_latency = None
        self._bad_streak = self._good_streak = 0
        self._update(now, "restarted")
        return True

    def _is_slow(self, latency: float) -> bool:
        if self.baseline is None:
            return False
        limit = max(self._settings.slow_factor * self.baseline, self.baseline + self._settings.slow_floor_s)
        return latency > limit

    def observe_probe(self, latency: float | None, now: float, queued: bool = False) -> None:
        """`latency` of a one-token probe: seconds, `math.inf` if it timed out, None if it failed.

        `queued`: the node's last heartbeat showed requests waiting.
        """
        timed_out = latency is not None and math.isinf(latency)
        waited = timed_out or (latency is not None and self._is_slow(latency))
        if queued and waited:
            return
        self.last_latency = None if timed_out else latency
        if latency is None or waited:
            self._bad_streak += 1
            self._good_streak = 0
            if latency is None or timed_out:
                why = "probe failed" if latency is None else "probe timed out"
            else:
                why = f"probe took {latency * 1000:.0f} ms (baseline {self.baseline * 1000:.0f} ms)"
        else:
            self._good_streak += 1
            self._bad_streak = 0
            why = "probes answer normally"
            if self.state == "healthy":
                self.baseline = latency if self.baseline is None else (1 - _BASELINE_ALPHA) * self.baseline + _BASELINE_ALPHA * latency
        self._update(now, why)

    def observe_feedback(self, kind: FeedbackKind, now: float, started_at: float = 0.0) -> None:
        """A client's complaint; `started_at`: the start of the process it is about (0: not said)."""
        if started_at and self.started_at is not None and started_at != self.started_at:
            return  # about another process under this id, gone or not yet seen here
        self._feedback.append((now, kind, started_at))
        self._update(now, f"clients report {kind}")

    def feedback_in_window(self, now: float) -> int:
        while self._feedback and now - self._feedback[0][0] > self._settings.feedback_window_s:
            self._feedback.popleft()
        return len(self._feedback)

    def _update(self, now: float, why: str) -> None:
        s = self._settings
        complaints = self.feedback_in_window(now)
        if self._bad_streak >= s.bad_probes_to_unhealthy:
            target: HealthState = "unhealthy"
        elif self._bad_streak >= s.bad_probes_to_suspect or complaints >= s.feedback_to_suspect:
            target = "unhealthy" if self.state == "unhealthy" else "suspect"
        elif self.state != "healthy" and self._good_streak < s.good_probes_to_recover:
            target = self.state
        else:
            target = "healthy"
        if target != self.state:
            self.state = target
            self.since = now
            self.reason = why if complaints < s.feedback_to_suspect else f"{complaints} client complaints in {s.feedback_window_s:.0f}s"

    def verdict(self, now: float) -> HealthVerdict:
        weight = {"healthy": 1.0, "suspect": self._settings.suspect_weight, "unhealthy": 0.0}[self.state]
        return HealthVerdict(
            worker_id=self.worker_id,
            state=self.state,
            weight=weight,
            reason=self.reason,
            since=self.since,
            probe_latency_s=self.last_latency,
            baseline_latency_s=self.baseline,
            feedback_in_window=self.feedback_in_window(now),
        )
