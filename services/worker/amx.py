"""Asking Linux for AMX tile state before any kernel may use it.

On Sapphire Rapids and later, a process must request permission for the
AMX tile-data state before executing AMX instructions, or the first one
kills it with SIGILL. vLLM's CPU attention uses AMX for short prompts (4
tokens or fewer) without asking first, so the worker asks at start, before
the engine and its subprocesses exist (they inherit the permission).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """True if the kernel granted AMX; False where AMX or the call is absent (harmless)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False
