"""Where the launcher's children run: a process group of their own, in the launcher's session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from launch.launcher import Launcher


def test_a_child_has_its_own_process_group_in_the_launchers_session(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path)
    try:
        child = launcher.spawn("sleeper", [sys.executable, "-c", "import signal; signal.pause()"])
        # Its own group: a Ctrl-C to the terminal's foreground group reaches the launcher alone.
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
        # The same session: where the kernel schedules sessions as groups (autogroups), a service of a
        # session of its own, woken for a message, waited behind a busy engine's session for hundreds of ms.
        assert os.getsid(child.pid) == os.getsid(0)
    finally:
        launcher.stop_all(timeout=5)
