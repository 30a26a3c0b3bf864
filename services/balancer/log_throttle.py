"""One log line per kind of event per interval, however often it happens (pure).

A degraded path taken by every request would otherwise write a line per
request, burying the rest of the log exactly when it matters. Each line
carries how many events it stands for, so nothing goes uncounted.
"""

from __future__ import annotations


class LogThrottle:
    def __init__(self, every_s: float) -> None:
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0, not {every_s}")
        self._every_s = every_s
        self._logged_at: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def due(self, kind: str, now: float) -> int:
        """Count one event of `kind`; 0 when it stays quiet, else the events this line stands for (itself included)."""
        held = self._held.get(kind, 0) + 1
        logged_at = self._logged_at.get(kind)
        if logged_at is not None and now - logged_at < self._every_s:
            self._held[kind] = held
            return 0
        self._logged_at[kind] = now
        self._held[kind] = 0
        return held
