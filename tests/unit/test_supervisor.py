"""The supervisor shell around the restart policy, on real child processes and a hand-moved clock."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from launch.launcher import LaunchError, Launcher, Process
from shared.restarts import RestartPolicy
from launch.supervisor import Supervisor, describe_exit, restart_policy_from
from shared.config import SupervisionSettings
from shared.runner import READY_EVENT

# Says which run it is (its environment reaches every run) and that it serves, then waits to be stopped.
SERVICE = ("import os, sys, time; print('run of', os.environ['MARK'], flush=True); "
           f"print('{READY_EVENT}', file=sys.stderr, flush=True); time.sleep(120)")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def launcher(tmp_path: Path):
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop_all(timeout=5)


def wait_for(condition, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def supervised(launcher: Launcher, members: list[Process], policy: RestartPolicy) -> tuple[Supervisor, Clock, list[str]]:
    clock, reports = Clock(), []
    supervisor = Supervisor(launcher, lambda: list(members), policy, reports.append, clock)
    assert supervisor.step() is None
    return supervisor, clock, reports


def test_a_killed_process_alone_is_restarted_as_it_was_started(launcher: Launcher) -> None:
    victim = launcher.spawn("worker-w0", [sys.executable, "-c", SERVICE], {"MARK": "w0"}, announces_ready=True)
    bystander = launcher.spawn("ingress", [sys.executable, "-c", SERVICE], {"MARK": "ingress"}, announces_ready=True)
    supervisor, clock, reports = supervised(launcher, [victim, bystander], RestartPolicy(first_delay_s=0.5))
    old_pid, bystander_pid = victim.pid, bystander.pid
    wait_for(victim.serves)
    victim.signal(signal.SIGKILL)
    victim.popen.wait(10)
    clock.now = 1.0
    assert supervisor.step() is None
    assert reports == [f"worker-w0 was killed by SIGKILL; restart 1 in 0.5s (log: {victim.log_path})"]
    clock.now = 1.4
    supervisor.step()
    assert not victim.alive(), "restarted before its delay"
    clock.now = 1.5
    supervisor.step()
    assert victim.alive() and victim.pid != old_pid
    assert reports[1] == f"worker-w0 restarted (pid {victim.pid}, restarts: 1)"
    assert bystander.pid == bystander_pid and bystander.alive()
    assert supervisor.restart_counts() == {"ingress": 0, "worker-w0": 1}
    wait_for(lambda: supervisor.step() is None and any("serves again" in line for line in reports))
    assert reports[-1].startswith("worker-w0 serves again, 0.5s after it went down")
    # Same command line and environment: the log holds both runs, each with its own mark.
    assert victim.log_path.read_text().count("run of w0") == 2


def test_a_crash_loop_is_given_up_with_the_reason(launcher: Launcher) -> None:
    crashing = launcher.spawn("balancer", [sys.executable, "-c", "raise SystemExit(3)"])
    supervisor, clock, reports = supervised(launcher, [crashing], RestartPolicy(first_delay_s=1.0, stable_after_s=10.0, limit=2))
    given_up = None
    for _ in range(10):
        crashing.popen.wait(10)
        clock.now += 0.5
        given_up = supervisor.step()
        if given_up is not None:
            break
        clock.now += 10.0  # past any delay: the restart is due
        supervisor.step()
    assert given_up == f"balancer exited with status 3, 3 times in a row within 10s of starting: given up (see {crashing.log_path})"
    assert [line.split(";")[0] for line in reports if "restart " in line] == ["balancer exited with status 3"] * 2
    assert supervisor.restart_counts() == {"balancer": 2}


def test_a_process_no_longer_listed_is_not_restarted(launcher: Launcher) -> None:
    drained = launcher.spawn("worker-w2", [sys.executable, "-c", SERVICE], {"MARK": "w2"})
    members = [drained]
    clock, reports = Clock(), []
    supervisor = Supervisor(launcher, lambda: list(members), RestartPolicy(), reports.append, clock)
    supervisor.step()
    members.clear()
    drained.stop(timeout=5)
    clock.now = 100.0
    assert supervisor.step() is None
    assert reports == [] and not drained.alive() and supervisor.restart_counts() == {}


def test_a_running_process_cannot_be_restarted(launcher: Launcher) -> None:
    running = launcher.spawn("ingress", [sys.executable, "-c", SERVICE], {"MARK": "i"})
    with pytest.raises(LaunchError, match="still runs"):
        launcher.restart(running)


def test_serving_is_read_from_the_current_run_only(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text(f"{READY_EVENT}\n")
    process = Process("worker", None, log, argv=["true"])  # type: ignore[arg-type]
    assert process.serves()
    process.log_offset = log.stat().st_size  # a restart: the old run's line no longer counts
    assert not process.serves()
    with log.open("a") as out:
        out.write(f"{READY_EVENT}\n")
    assert process.serves()


def test_exits_are_described_for_people() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL"
    assert describe_exit(2) == "exited with status 2"
    assert describe_exit(-200) == "was killed by signal 200"


def test_the_configured_settings_become_the_policy() -> None:
    assert restart_policy_from(SupervisionSettings(restart_limit=0)).limit == 0
    with pytest.raises(ValueError, match="max_delay_s"):
        restart_policy_from(SupervisionSettings(first_delay_s=5.0, max_delay_s=1.0))
