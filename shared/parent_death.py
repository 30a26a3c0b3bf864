"""Children that end with the process that started them, however it ends."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def ending_with(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn` that makes the child get SIGTERM when its parent dies, however it dies (Linux).

    The signal comes when the thread that started the child ends, so start
    children from a thread that lives as long as the process (the main one,
    or the event loop's).
    """
    def preexec() -> None:
        if _LIBC is None:
            return
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before the line above
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
