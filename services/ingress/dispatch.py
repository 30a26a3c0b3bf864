"""Getting one request run: route it, hand it to a worker, relay its frames.

A worker that is gone (no responders), slow to accept, or draining is
excluded and the request is routed again, up to `dispatch_attempts` times.
Once a worker has accepted, its frames are relayed until the final one; a
stream that stalls past `stall_timeout_s` is aborted on the worker and
failed with a clear error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import structlog

from contracts import subjects
from contracts.messages import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    RouteDecision,
    RouteReply,
    RouteRequest,
    StreamEnd,
    TokenChunk,
    WorkerReply,
)
from services.ingress.errors import ApiError
from services.ingress.prompts import PreparedRequest
from shared.bus import Bus, BusError, NoResponders, RequestTimeout, StreamReceiver
from shared.config import IngressSettings

log = structlog.get_logger("kvlane.ingress")

_RETRYABLE_WORKER_CODES = {"draining"}


class Dispatcher:
    def __init__(self, bus: Bus, streams: StreamReceiver, settings: IngressSettings) -> None:
        self._bus = bus
        self._streams = streams
        self._settings = settings

    async def run(self, request_id: str, prepared: PreparedRequest) -> AsyncIterator[TokenChunk | StreamEnd]:
        """The request's chunks, ending with its `StreamEnd`; raises `ApiError`."""
        deadline = time.time() + self._settings.request_timeout_s
        excluded: list[str] = []
        for attempt in range(self._settings.dispatch_attempts):
            decision = await self._route(request_id, prepared, deadline, excluded)
            with self._streams.open(f"{request_id}-{attempt}") as stream:
                generate = GenerateRequest(
                    request_id=request_id,
                    model=prepared.model,
                    prompt_token_ids=prepared.prompt_token_ids,
                    sampling=prepared.sampling,
                    stream_to=stream.subject,
                    deadline=deadline,
                )
                try:
                    reply = await self._bus.request(decision.inbox, generate, WorkerReply, self._settings.accept_timeout_s)
                except (NoResponders, RequestTimeout) as exc:
                    log.warning("worker_unreachable", request_id=request_id, worker_id=decision.worker_id, error=str(exc))
                    excluded.append(decision.worker_id)
                    continue
                except BusError as exc:
                    raise ApiError(502, f"bad reply from worker: {exc}", code="bad_gateway") from exc
                if isinstance(reply, ErrorReply):
                    if reply.code in _RETRYABLE_WORKER_CODES:
                        excluded.append(decision.worker_id)
                        continue
                    raise ApiError.from_reply(reply)
                async for frame in self._relay(request_id, decision, stream):
                    yield frame
                return
        raise ApiError(
            503, f"no worker accepted the request after {self._settings.dispatch_attempts} attempts",
            code="no_capacity", retry_after_s=1.0,
        )

    async def _route(self, request_id: str, prepared: PreparedRequest, deadline: float, excluded: list[str]) -> RouteDecision:
        route = RouteRequest(
            request_id=request_id,
            model=prepared.model,
            prompt_tokens=len(prepared.prompt_token_ids),
            max_tokens=prepared.sampling.max_tokens,
            deadline=deadline,
            block_hashes=prepared.block_hashes,
            exclude_workers=excluded,
        )
        try:
            reply = await self._bus.request(subjects.ROUTE, route, RouteReply, self._settings.route_timeout_s)
        except NoResponders as exc:
            raise ApiError(503, "no balancer is running", code="balancer_unavailable", retry_after_s=1.0) from exc
        except BusError as exc:
            raise ApiError(503, f"routing failed: {exc}", code="balancer_unavailable", retry_after_s=1.0) from exc
        if isinstance(reply, ErrorReply):
            raise ApiError.from_reply(reply)
        return reply

    async def _relay(self, request_id: str, decision: RouteDecision, stream) -> AsyncIterator[TokenChunk | StreamEnd]:
        finished = False
        expected_seq = 0
        try:
            while True:
                try:
                    frame = await stream.next(self._settings.stall_timeout_s)
                except RequestTimeout as exc:
                    raise ApiError(504, f"worker {decision.worker_id} stalled: {exc}", code="worker_stalled") from exc
                match frame:
                    case ErrorReply():
                        finished = True
                        raise ApiError.from_reply(frame)
                    case TokenChunk() | StreamEnd():
                        if frame.seq != expected_seq:
                            raise ApiError(502, f"stream from {decision.worker_id} lost frames", code="stream_gap")
                        expected_seq += 1
                        finished = isinstance(frame, StreamEnd)
                        yield frame
                        if finished:
                            return
        finally:
            if not finished:
                # The client left or the stream failed: free the worker's slot.
                with contextlib.suppress(Exception):
                    await self._bus.publish(decision.inbox, AbortRequest(request_id=request_id))
