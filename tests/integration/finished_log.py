"""Which worker ran each client request, from `RequestFinished` events on NATS."""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractAsyncContextManager

from contracts.messages import RequestFinished
from launch.fleet import Fleet
from loadtest.dataplane.hangup import FinishedWatch


class FinishedLog(FinishedWatch):
    """The client requests that finished: health probes and pre-warm prefills are not client
    traffic, and an aborted attempt was resumed and finishes again elsewhere."""

    def keeps(self, finished: RequestFinished) -> bool:
        return not finished.request_id.startswith(("probe-", "prewarm-")) and finished.finish_reason != "abort"

    def workers(self) -> Counter[str]:
        return Counter(e.worker_id for e in self.events)

    def share(self, worker_id: str) -> float:
        return self.workers()[worker_id] / max(1, len(self.events))


def watch_finished(fleet: Fleet) -> AbstractAsyncContextManager[FinishedLog]:
    """`async with watch_finished(fleet) as log:`, subscribed on entry; its NATS client is closed on exit, failed or not."""
    return FinishedLog.open(fleet.config.nats.url)  # type: ignore[return-value]
