"""What counts as a slow stream, per node (pure)."""

from __future__ import annotations

_ALPHA = 0.1
_WARMUP_STREAMS = 5


class StreamSpeedNorms:
    """An exponential average of each node's inter-token latency.

    A stream whose mean inter-token latency exceeds `slow_factor` times its
    node's norm is slow. Slow streams do not move the norm, so a node that
    turns slow keeps being reported instead of redefining normal.
    """

    def __init__(self, slow_factor: float) -> None:
        self._slow_factor = slow_factor
        self._norms: dict[str, tuple[float, int]] = {}

    def observe(self, worker_id: str, mean_itl_s: float) -> bool:
        """Record one finished stream; True if it was slow for this node."""
        norm, count = self._norms.get(worker_id, (mean_itl_s, 0))
        slow = count >= _WARMUP_STREAMS and mean_itl_s > self._slow_factor * norm
        if not slow:
            self._norms[worker_id] = ((1 - _ALPHA) * norm + _ALPHA * mean_itl_s, count + 1)
        return slow

    def norm(self, worker_id: str) -> float | None:
        entry = self._norms.get(worker_id)
        return entry[0] if entry else None
