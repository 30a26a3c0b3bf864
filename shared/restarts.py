"""When `kvlane up` restarts a process that exited on its own, and when it gives up.

A pure state machine (no processes, no clock of its own): the supervisor
(launch/supervisor.py) tells it when each process started and exited, and
asks which restarts are due. The rules are systemd's and Kubernetes':

* an exit is followed by a restart after a delay that doubles with each
  exit in a row (`first_delay_s`, 2x, 4x... up to `max_delay_s`);
* a process that ran `stable_after_s` before it exited was healthy: its
  delay starts over from `first_delay_s`;
* after `limit` restarts in a row, each ended before `stable_after_s`, the
  process is crash-looping: the next exit gives up instead (0: never
  restart, the behaviour of a fleet that stops when any member stops).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0
    limit: int = 5

    def __post_init__(self) -> None:
        if not self.first_delay_s > 0:
            raise ValueError(f"first_delay_s must be positive, not {self.first_delay_s!r}")
        if not self.max_delay_s >= self.first_delay_s:
            raise ValueError(f"max_delay_s ({self.max_delay_s!r}) must be at least first_delay_s ({self.first_delay_s!r})")
        if not self.stable_after_s > 0:
            raise ValueError(f"stable_after_s must be positive, not {self.stable_after_s!r}")
        if self.limit < 0:
            raise ValueError(f"limit must be 0 or more, not {self.limit!r}")

    def delay(self, failures: int) -> float:
        """The wait before the restart that follows the `failures`-th quick exit in a row (1: the first)."""
        delay = self.first_delay_s
        for _ in range(failures - 1):
            if delay >= self.max_delay_s:
                break
            delay *= 2
        return min(delay, self.max_delay_s)


@dataclass(frozen=True)
class Restart:
    """Start the process again at `at` (`restarts`: how many times it will then have been restarted)."""

    at: float
    delay_s: float
    restarts: int


@dataclass(frozen=True)
class GiveUp:
    """The process exited `failures` times in a row, each time within `stable_after_s` of starting."""

    failures: int
    ran_s: float


@dataclass
class _Record:
    started_at: float
    restarts: int = 0
    # Exits in a row that each came before the process had run stable_after_s.
    failures: int = 0
    restart_at: float | None = None


@dataclass
class RestartBook:
    """Every supervised process's history, by name."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    _records: dict[str, _Record] = field(default_factory=dict)

    def started(self, name: str, now: float) -> None:
        """`name` (re)started at `now`; the first call for a name registers it."""
        record = self._records.get(name)
        if record is None:
            self._records[name] = _Record(started_at=now)
            return
        if record.restart_at is not None:
            record.restarts += 1
            record.restart_at = None
        record.started_at = now

    def exited(self, name: str, now: float) -> Restart | GiveUp:
        """`name` exited at `now` without being asked to: restart it (when), or give up on it."""
        record = self._records.get(name)
        if record is None:
            raise KeyError(f"{name} exited but was never started")
        if record.restart_at is not None:
            raise ValueError(f"{name} exited twice without a start between")
        ran_s = max(0.0, now - record.started_at)
        record.failures = 1 if ran_s >= self.policy.stable_after_s else record.failures + 1
        if record.failures > self.policy.limit:
            return GiveUp(record.failures, ran_s)
        delay_s = self.policy.delay(record.failures)
        record.restart_at = now + delay_s
        return Restart(record.restart_at, delay_s, record.restarts + 1)

    def due(self, now: float) -> list[str]:
        """The processes whose restart time has come, longest waiting first."""
        waiting = [(r.restart_at, name) for name, r in self._records.items() if r.restart_at is not None and r.restart_at <= now]
        return [name for _, name in sorted(waiting)]

    def waiting(self, name: str) -> bool:
        """Whether `name` has exited and waits for its restart."""
        record = self._records.get(name)
        return record is not None and record.restart_at is not None

    def forget(self, name: str) -> None:
        """`name` left the fleet on purpose (a drained worker): no restart, no history."""
        self._records.pop(name, None)

    def restarts(self, name: str) -> int:
        record = self._records.get(name)
        return 0 if record is None else record.restarts

    def counts(self) -> dict[str, int]:
        """Restarts so far, by process name (every process started, restarted or not)."""
        return {name: record.restarts for name, record in sorted(self._records.items())}
