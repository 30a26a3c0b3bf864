"""`kvlane up` keeps its processes running: one that exits on its own is restarted alone.

The decisions (when to restart, when to give up) are shared/restarts.py's;
this only watches the processes and carries the decisions out. A restarted
process is started exactly as before (launch/launcher.py keeps its command
line and environment), so a worker comes back with its worker id and ports
and an ingress on its port, while every other process goes on serving.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

from launch.launcher import LaunchError, Launcher, Process
from shared.restarts import GiveUp, RestartBook, RestartPolicy
from shared.config import SupervisionSettings


def restart_policy_from(settings: SupervisionSettings) -> RestartPolicy:
    """The configured policy (ValueError, saying which setting, when the settings contradict each other)."""
    return RestartPolicy(first_delay_s=settings.first_delay_s, max_delay_s=settings.max_delay_s,
                         stable_after_s=settings.stable_after_s, limit=settings.restart_limit)


def describe_exit(returncode: int | None) -> str:
    if returncode is None:
        return "is running"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class Supervisor:
    """Call `step` every fraction of a second; it returns why the fleet must stop, or None while all is well.

    `members` lists the processes to keep running at the time of the call: one
    that is no longer listed (a worker drained on purpose) is forgotten, one
    newly listed is watched from then on.
    """

    def __init__(
        self,
        launcher: Launcher,
        members: Callable[[], list[Process]],
        policy: RestartPolicy,
        report: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._launcher = launcher
        self._members = members
        self._policy = policy
        self._book = RestartBook(policy)
        self._report = report
        self._clock = clock
        self._watched: set[str] = set()
        # Restarted processes that have not yet said they serve, with when they went down.
        self._coming_back: dict[str, tuple[Process, float]] = {}
        self._down_since: dict[str, float] = {}

    def restart_counts(self) -> dict[str, int]:
        return self._book.counts()

    def step(self) -> str | None:
        now = self._clock()
        members = {process.name: process for process in self._members()}
        for name in self._watched - members.keys():
            self._book.forget(name)
            self._coming_back.pop(name, None)
            self._down_since.pop(name, None)
        self._watched &= members.keys()
        for name, process in members.items():
            if name not in self._watched:
                self._watched.add(name)
                self._book.started(name, now)
            if process.alive() or self._book.waiting(name):
                continue
            self._coming_back.pop(name, None)
            decision = self._book.exited(name, now)
            how = describe_exit(process.popen.returncode)
            if isinstance(decision, GiveUp):
                return (f"{name} {how}, {decision.failures} times in a row within {self._policy.stable_after_s:g}s "
                        f"of starting: given up (see {process.log_path})")
            self._down_since.setdefault(name, now)
            self._report(f"{name} {how}; restart {decision.restarts} in {decision.delay_s:g}s (log: {process.log_path})")
        for name in self._book.due(now):
            process = members[name]
            try:
                self._launcher.restart(process)
            except (OSError, LaunchError) as exc:
                return f"{name} could not be restarted: {exc}"
            self._book.started(name, now)
            self._report(f"{name} restarted (pid {process.pid}, restarts: {self._book.restarts(name)})")
            if process.announces_ready:
                self._coming_back[name] = (process, self._down_since[name])
            else:
                self._down_since.pop(name, None)
        for name, (process, down_since) in list(self._coming_back.items()):
            if process.serves():
                del self._coming_back[name]
                self._down_since.pop(name, None)
                self._report(f"{name} serves again, {now - down_since:.1f}s after it went down")
        return None
