"""Route requests over NATS with a fixed number in flight, each followed by its RequestFinished: the load
generator of the balancer benchmark's throughput run.

Lean on purpose, so that on a small machine the balancer rather than its client sets the rate: the requests
are encoded before the run, every reply arrives on one wildcard subscription and is matched by the suffix of
its reply subject, and the next request is sent from the reply callback (no task, future or timer per request).
"""

from __future__ import annotations

import asyncio

import msgspec

from contracts import subjects
from contracts.messages import RequestFinished, RouteDecision, RouteReply, Usage


class RouteWindow:
    """Sends every payload (an encoded RouteRequest) to the balancer, `window` in flight, and publishes one
    RequestFinished per decision on the node it names."""

    def __init__(self, nc, payloads: list[bytes], request_ids: list[str], window: int) -> None:
        self._nc = nc
        self._payloads = payloads
        self._request_ids = request_ids
        self._window = window
        self._decoder = msgspec.msgpack.Decoder(RouteReply)
        self._encoder = msgspec.msgpack.Encoder()
        self._reply_prefix = ""
        self._sent = 0
        self._answered = 0
        self._done: asyncio.Future[None] | None = None

    async def run(self, timeout_s: float) -> None:
        """Until every request is answered and its RequestFinished published; raises on a refusal or a timeout."""
        self._done = asyncio.get_running_loop().create_future()
        self._reply_prefix = self._nc.new_inbox() + "."
        subscription = await self._nc.subscribe(self._reply_prefix + "*", cb=self._replied)
        try:
            for _ in range(min(self._window, len(self._payloads))):
                await self._send_next()
            await asyncio.wait_for(self._done, timeout_s)
            await self._nc.flush()
        finally:
            await subscription.unsubscribe()

    async def _send_next(self) -> None:
        i = self._sent
        self._sent += 1
        await self._nc.publish(subjects.ROUTE, self._payloads[i], reply=self._reply_prefix + str(i))

    async def _replied(self, msg) -> None:
        if self._done is None or self._done.done():
            return
        i = int(msg.subject[len(self._reply_prefix):])
        reply = self._decoder.decode(msg.data)
        if not isinstance(reply, RouteDecision):
            self._done.set_exception(RuntimeError(f"route request {i}: {reply}"))
            return
        finished = RequestFinished(request_id=self._request_ids[i], worker_id=reply.worker_id, finish_reason="stop",
                                   usage=Usage(1, 1), duration_s=0.0)
        await self._nc.publish(subjects.REQUEST_FINISHED, self._encoder.encode(finished))
        self._answered += 1
        if self._sent < len(self._payloads):
            await self._send_next()
        elif self._answered == len(self._payloads):
            self._done.set_result(None)
