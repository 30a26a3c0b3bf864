"""Waiting for an event in tests: a bounded poll, never a fixed sleep."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


async def until(condition: Callable[[], Any], timeout: float, what: Any = "the condition", every_s: float = 0.05) -> float:
    """Seconds until `condition()` (plain or a coroutine function) holds; `what` (text, or a function giving it)
    names it on failure."""
    started = time.monotonic()
    while not await _value(condition()):
        assert time.monotonic() - started < timeout, f"not within {timeout:.0f}s: {what() if callable(what) else what}"
        await asyncio.sleep(every_s)
    return time.monotonic() - started


async def _value(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def wait_for(condition: Callable[[], Any], timeout: float, what: Any) -> Any:
    """`condition()`'s first true result, polled from synchronous code, bounded by `timeout`; `what` (text, or a
    function giving it) names it on failure."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what() if callable(what) else what}"
        time.sleep(0.05)
    return result
