"""Which worker ran each client request, from `RequestFinished` events on NATS."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator

import msgspec
import nats

from contracts import subjects
from contracts.messages import RequestFinished
from kvlane.fleet import Fleet


class FinishedLog:
    def __init__(self) -> None:
        self.events: list[RequestFinished] = []

    def workers(self) -> Counter[str]:
        return Counter(e.worker_id for e in self.events)

    def share(self, worker_id: str) -> float:
        return self.workers()[worker_id] / max(1, len(self.events))


@contextlib.asynccontextmanager
async def watch_finished(fleet: Fleet) -> AsyncIterator[FinishedLog]:
    """`async with watch_finished(fleet) as log:`, subscribed on entry; its NATS client is closed on exit, failed or not."""
    nc = await nats.connect(fleet.config.nats.url)
    log = FinishedLog()
    decoder = msgspec.msgpack.Decoder(RequestFinished)

    async def on_finished(msg) -> None:
        event = decoder.decode(msg.data)
        # Health probes and pre-warm prefills are not client traffic; an
        # aborted attempt was resumed and finishes again elsewhere.
        if not event.request_id.startswith(("probe-", "prewarm-")) and event.finish_reason != "abort":
            log.events.append(event)

    await nc.subscribe(subjects.REQUEST_FINISHED, cb=on_finished)
    # Twice, as `loadtest.hangup.FinishedWatch` does: nats-py can write a flush's PING ahead of the SUB still queued.
    await nc.flush()
    await nc.flush()
    try:
        yield log
    finally:
        await nc.close()
