"""What a benchmark records about the machine it ran on: CPU use per process and versions."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from launch.launcher import Process, find_nats_server, find_redis_server

# --- CPU accounting ------------------------------------------------------------------

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux /proc; None elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces; fields start at `state`
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _machine_cpu_seconds() -> tuple[float, float, float] | None:
    """(busy, steal, irq + softirq) CPU seconds of the whole machine so far (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    fields += [0] * (8 - len(fields))
    # user nice system idle iowait irq softirq steal [guest guest_nice, already inside user/nice]
    total = sum(fields[:8])
    idle = fields[3] + fields[4]
    return (total - idle) / _CLOCK_TICKS, fields[7] / _CLOCK_TICKS, (fields[5] + fields[6]) / _CLOCK_TICKS


class CpuMeter:
    """CPU used by each fleet process and by this client between two samples."""

    def __init__(self, processes: Sequence[Process]) -> None:
        self._processes = list(processes)

    def sample(self) -> dict[str, float | None]:
        sample = {p.name: _cpu_seconds(p.pid) for p in self._processes}
        times = os.times()
        sample["loadtest-client"] = times.user + times.system
        machine = _machine_cpu_seconds()
        sample["machine-busy"], sample["machine-steal"], sample["machine-irq"] = machine or (None, None, None)
        return sample

    @staticmethod
    def percent(before: dict[str, float | None], after: dict[str, float | None], wall_s: float) -> dict[str, float | None]:
        """Per process: CPU seconds / wall seconds, as a percentage of one core.

        `machine-busy` is the whole machine (this run's processes, any
        other's, and the kernel), out of 100 x the CPU count; `machine-irq`
        the part of it spent in interrupts (loopback networking, mostly);
        `machine-steal` time the hypervisor gave to other guests;
        `other-processes` what is busy beyond this run's processes and irq.
        """
        out: dict[str, float | None] = {}
        for name, start in before.items():
            end = after.get(name)
            out[name] = None if start is None or end is None or wall_s <= 0 else 100.0 * (end - start) / wall_s
        ours = [v for k, v in out.items() if not k.startswith("machine-")]
        if out.get("machine-busy") is not None and None not in ours:
            out["other-processes"] = max(0.0, out["machine-busy"] - (out.get("machine-irq") or 0.0) - sum(ours))
        return out



# --- machine and versions ------------------------------------------------------------------


def _binary_version(argv: list[str]) -> str | None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout or done.stderr).strip().splitlines()[0] if (done.stdout or done.stderr).strip() else None


def machine_info() -> dict[str, Any]:
    versions = {}
    for dist in ("aiohttp", "nats-py", "uvloop", "msgspec", "redis"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "packages": versions,
    }
    with contextlib.suppress(Exception):
        info["nats_server"] = _binary_version([find_nats_server(), "--version"])
    with contextlib.suppress(Exception):
        info["redis_server"] = _binary_version([find_redis_server(), "--version"])
    return info
