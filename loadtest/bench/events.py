"""Listening to the fleet's `RequestFinished` events during a run.

Workers publish one event per request they ran on `kvlane.v1.events.finished`
(msgpack of `contracts.messages.RequestFinished`); its `request_id` is the
`X-Request-Id` the client saw, so each record can be matched to its worker.
Events are decoded loosely (a plain msgpack map, only the fields used here),
so a field added to the contract later does not break the benchmark.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from contracts import subjects
from loadtest.bench.metrics import WorkerRun


class FinishedEvents:
    def __init__(self, nats_url: str) -> None:
        self._url = nats_url
        self._nc: NatsClient | None = None
        self.runs: dict[str, WorkerRun] = {}
        self.undecodable = 0

    async def __aenter__(self) -> FinishedEvents:
        self._nc = await nats.connect(self._url, connect_timeout=5, max_reconnect_attempts=3, allow_reconnect=True,
                                      name="kvlane-bench-events")
        await self._nc.subscribe(subjects.REQUEST_FINISHED, cb=self._on_message)
        await self._nc.flush(timeout=5)  # the subscription is live before the first request goes out
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._nc.drain(), timeout=5)

    async def _on_message(self, msg: Msg) -> None:
        try:
            event = msgspec.msgpack.decode(msg.data)
            self.runs[str(event["request_id"])] = WorkerRun(
                worker_id=str(event["worker_id"]),
                duration_s=float(event.get("duration_s", float("nan"))),
                finish_reason=str(event.get("finish_reason", "")),
            )
        except (msgspec.DecodeError, KeyError, TypeError, ValueError, AttributeError):
            self.undecodable += 1
