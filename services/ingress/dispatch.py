"""Getting one request run: route it, hand it to a worker, relay its frames.

A worker that is gone (no responders), slow to accept, or draining is
excluded and the request is routed again, up to `dispatch_attempts` times.

Once a worker has accepted, its frames are relayed. If the stream breaks
off (the worker dies, stalls, drops frames, fails, is preempted, or hands
the request back because it is leaving: drain timeout, dead engine), the
request resumes on another worker (or the same one, after a preemption)
with the tokens already relayed as `resume_token_ids`: the client's stream
goes on with no duplicated and no missing token, and its frames keep one
sequence. At most `migration_attempts` resumptions, and of those at most
`node_loss_resumes` after the node died under the request (a request that
crashes its engine must not take the fleet down node by node); then an
explicit error.

While no balancer answers (a balancer restarting, say), the route request
is held and asked again when a balancer heartbeats (or after a short
backoff), for at most `balancer_wait_s` within the request's deadline, then
503 with Retry-After: a control-plane restart is not the client's error.

Those decisions are `RequestFlight`'s (services/ingress/flight.py), a pure
state machine the virtual-time simulator runs too; this module does the I/O
around it: route requests, hand-overs, relaying, aborts, spans, metrics.

The route request carries the worker's request (`hand_over`), and the
balancer sends it on to the node it chose as it replies: the worker's
answer comes straight here, one NATS round trip sooner than if this side
sent it after the decision. Where the balancer did not (a two-node chain, a
degraded request, `ingress.balancer_hands_over` off), this side sends it.

A two-node chain (the decision names a prefill node) starts with a
`PrefillRequest` to the prefill node, which hands the request to the decode
node and says so with a `Handoff` frame; tokens come from the decode node.
Until the hand-off both nodes are watched, then only the decode node; a
failure is charged to the node that caused it, which the next route excludes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import NamedTuple

import msgspec
import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Tracer

from contracts import subjects
from contracts.health import FeedbackKind, NodeFeedback
from contracts.messages import (
    AbortRequest,
    ErrorReply,
    GenerateAccepted,
    GenerateRequest,
    Handoff,
    PrefillRequest,
    RouteDecision,
    RouteRequest,
    RouteWithdrawn,
    StreamEnd,
    TokenChunk,
    WorkerReply,
)
from services.ingress.balancers import RouteAsker
from services.ingress.errors import ApiError
from services.ingress.feedback import StreamSpeedNorms
from services.ingress.flight import AwaitBalancer, Done, Fail, RequestFlight, StreamInterrupted
from services.ingress.metrics import IngressMetrics
from services.ingress.prompts import PreparedRequest
from shared.bus import Bus, BusError, NoResponders, ReplySlot, ReplyStream, RequestTimeout, StreamReceiver
from shared.config import IngressSettings
from shared.telemetry import error_type, set_error

log = structlog.get_logger("kvlane.ingress")

_RETRYABLE_WORKER_CODES = {"draining"}


class _Attempt:
    """The span of one dispatch attempt: its route, hand-over and relay (`dispatch.attempt`).

    A migration or a preemption starts another attempt in the same trace; the
    attempt's bus messages carry its context, so the balancer's and the
    workers' spans are its children. Nothing here runs per token.
    """

    def __init__(self, tracer: Tracer, parent: Context | None, number: int, request_id: str, resumed_tokens: int) -> None:
        self.outcome = "unknown"
        if isinstance(tracer, trace.NoOpTracer) and not trace.get_current_span(parent).get_span_context().is_valid:
            # Tracing off and no caller's trace to continue: no span to make (its methods below do nothing).
            self.span, self.context = trace.INVALID_SPAN, parent
            return
        self.span = tracer.start_span("dispatch.attempt", context=parent, attributes={
            "kvlane.attempt": number, "kvlane.request_id": request_id, "kvlane.resumed_tokens": resumed_tokens,
        })
        self.context = trace.set_span_in_context(self.span, parent)

    def routed(self, decision: RouteDecision) -> None:
        if self.span.is_recording():
            self.span.set_attributes({
                "kvlane.worker.id": decision.worker_id, "kvlane.route.policy": decision.policy,
                "kvlane.route.cached_blocks": decision.cached_blocks, "kvlane.handed_over": decision.handed_over,
                **({"kvlane.prefill_worker.id": decision.prefill_worker_id} if decision.prefill_worker_id else {}),
            })

    def refused(self, worker_id: str) -> None:
        self.outcome = "not_accepted"
        self.span.set_attribute("kvlane.refused_by", worker_id)

    def interrupted(self, interruption: StreamInterrupted) -> None:
        self.outcome = "preempted" if interruption.preempted else "interrupted"
        self.span.set_attribute("kvlane.interruption.reason", interruption.reason)
        if interruption.culprit:
            self.span.set_attribute("kvlane.interruption.culprit", interruption.culprit)
        if not interruption.preempted:
            set_error(self.span, "stream_interrupted", interruption.reason)

    def failed(self, exc: BaseException) -> None:
        if self.outcome == "finished":
            return  # the caller stopped reading once it had the final frame
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            self.outcome = "cancelled"  # the caller left
        else:
            self.outcome = "failed"
            set_error(self.span, error_type(exc), str(exc))

    def end(self) -> None:
        self.span.set_attribute("kvlane.outcome", self.outcome)
        self.span.end()


class RouteUnanswered(Exception):
    """No balancer answered the route request in time (`Dispatcher._route`)."""


class NoBalancer(Exception):
    """No balancer took the route request: none listens, or every replica heard from is silent (`Dispatcher._route`)."""


class _HandOver(NamedTuple):
    """The worker's request, for the balancer to send on, and where the worker then answers."""

    request: GenerateRequest
    reply: ReplySlot


def _start_of(worker_id: str, accepted: GenerateAccepted) -> float:
    """When the process `worker_id` ran the request as started, as far as its acceptance says (0: not known)."""
    return accepted.started_at if accepted.worker_id == worker_id else 0.0


def _inboxes(decision: RouteDecision) -> list[str]:
    return [decision.inbox, *([decision.prefill_inbox] if decision.prefill_inbox else [])]


class Dispatcher:
    def __init__(
        self,
        bus: Bus,
        streams: StreamReceiver,
        settings: IngressSettings,
        live_start: Callable[[str], float | None],
        max_queue_wait_s: float,
        norms: StreamSpeedNorms | None = None,
        metrics: IngressMetrics | None = None,
        tracer: Tracer | None = None,
        routes: RouteAsker | None = None,
    ) -> None:
        self._bus = bus
        # Without one that listens for balancer heartbeats: every route request to the balancers' queue group.
        self._routes = routes or RouteAsker(bus)
        self._streams = streams
        self._settings = settings
        # When the process now live as a node started (`ClusterView.live_start`); None: that node is gone.
        self._live_start = live_start
        self._max_queue_wait_s = max_queue_wait_s
        self._norms = norms or StreamSpeedNorms(settings.slow_stream_factor)
        self._metrics = metrics
        self._tracer = tracer or trace.NoOpTracer()

    async def run(
        self, request_id: str, prepared: PreparedRequest, trace_context: Context | None = None,
        on_capped: Callable[[int], None] = lambda max_tokens: None,
    ) -> AsyncIterator[TokenChunk | StreamEnd]:
        """The request's chunks, ending with its `StreamEnd`; raises `ApiError`.

        Each attempt is a `dispatch.attempt` span, child of `trace_context` (the request's span).
        A balancer that degrades the request under overload caps its tokens:
        `on_capped` hears the request's new `max_tokens`.
        """
        # On this host's monotonic clock; each message carries the time left (hosts' clocks disagree).
        deadline = time.monotonic() + self._settings.request_timeout_s
        flight = RequestFlight(self._settings, prepared.sampling.max_tokens, prepared.sampling.n)
        route = flight.start()
        while True:
            attempt = _Attempt(self._tracer, trace_context, route.attempt, request_id, len(route.produced))
            # Where the worker answers if the balancer sends the request on: listened to before it can.
            reply = await self._bus.reply_slot() if self._settings.balancer_hands_over else None
            with contextlib.ExitStack() as closing, self._streams.open(f"{request_id}-{route.attempt - 1}") as stream:
                if reply is not None:
                    closing.callback(reply.close)
                hand_over = None if reply is None else _HandOver(
                    self._worker_request(request_id, prepared, None, stream, deadline, route.produced, accept_to=reply.subject),
                    reply,
                )
                try:
                    decision = await self._route(request_id, prepared, deadline, route.exclude, len(route.produced),
                                                 attempt.context, hand_over)
                except asyncio.CancelledError as exc:
                    # The client left while its request was routed or queued: a slot and a lease may
                    # be reserved for it by now (and the request handed over); free them rather than
                    # at its deadline.
                    with contextlib.suppress(Exception):
                        await self._bus.publish(subjects.ROUTE_WITHDRAWN, RouteWithdrawn(request_id), context=attempt.context)
                    attempt.failed(exc)
                    attempt.end()
                    raise
                except NoBalancer as exc:
                    attempt.failed(exc)
                    attempt.end()
                    held = flight.on_no_balancer(time.monotonic(), deadline - time.monotonic())
                    if isinstance(held, Fail):
                        raise held.error from exc
                    await self._await_balancer(request_id, held)
                    route = held.route
                    continue
                except RouteUnanswered as exc:
                    again = flight.on_unanswered(str(exc))
                    if isinstance(again, Fail):
                        attempt.failed(again.error)
                        attempt.end()
                        raise again.error from exc
                    log.warning("route_unanswered", request_id=request_id, error=str(exc))
                    attempt.failed(exc)
                    attempt.end()
                    # Asked again as a new attempt: a worker the silent balancer handed the request to answers and
                    # streams to this attempt's reply slot and stream, not into the next one's; and is told to stop.
                    if reply is not None:
                        closing.pop_all()
                        self._bus.spawn(self._abort_when_accepted(request_id, reply, stream.subject, deadline))
                    route = again
                    continue
                except BaseException as exc:
                    attempt.failed(exc)
                    attempt.end()
                    raise
                attempt.routed(decision)
                if self._metrics is not None:
                    self._metrics.queued(prepared.model, decision.queued_s)
                handing = flight.on_decision(decision.max_tokens)
                if handing.capped:
                    sampling = msgspec.structs.replace(prepared.sampling, max_tokens=handing.max_tokens)
                    prepared = msgspec.structs.replace(prepared, sampling=sampling)
                    on_capped(handing.max_tokens)
                # From the hand-over on, the chain's nodes may be running the request: unless it
                # ended (or was abandoned) here, whatever stops this attempt aborts it there: the
                # client hanging up (its handler cancelled, or this generator closed), an error.
                settled = False
                try:
                    accepted = await self._hand_over(request_id, prepared, decision, stream, deadline, flight.produced,
                                                     attempt.context, hand_over)
                    if isinstance(accepted, str):
                        # A node that was merely slow to accept may run it all the same.
                        settled = True
                        attempt.refused(accepted)
                        await self._abort(request_id, stream.subject, decision, "not_accepted", attempt.context)
                        elsewhere = flight.on_refused(accepted)
                        if isinstance(elsewhere, Fail):
                            raise elsewhere.error
                        route = elsewhere
                        continue
                    async for frame in self._relay(request_id, decision, stream, accepted):
                        relayed = flight.on_frame(frame)
                        if isinstance(relayed, Done):
                            settled = True
                            attempt.outcome = "finished"
                        yield relayed.frame
                    return
                except StreamInterrupted as exc:
                    settled = True  # _abandon tells the workers
                    attempt.interrupted(exc)
                    await self._abandon(request_id, stream.subject, decision, exc, accepted, attempt.context)
                    resumed = flight.on_interrupted(exc)
                    if isinstance(resumed, Fail):
                        raise resumed.error from exc
                    if self._metrics is not None:
                        self._metrics.migrated(prepared.model, exc.cause)
                    log.warning("stream_resumed", request_id=request_id, worker_id=exc.culprit or decision.worker_id,
                                reason=exc.reason, tokens_so_far=len(flight.produced))
                    route = resumed
                except BaseException as exc:
                    attempt.failed(exc)
                    raise
                finally:
                    if not settled:
                        await self._abort(request_id, stream.subject, decision, "client_disconnected", attempt.context)
                    attempt.end()

    async def _await_balancer(self, request_id: str, held: AwaitBalancer) -> None:
        if self._metrics is not None:
            self._metrics.balancer_waited()
        log.info("route_held_for_a_balancer", request_id=request_id, attempt=held.route.attempt, wait_s=held.wait_s)
        await self._routes.wait_for_heartbeat(held.wait_s)

    async def _abort_when_accepted(self, request_id: str, reply: ReplySlot, stream_to: str, deadline: float) -> None:
        """Stop the run of an attempt whose route no balancer answered, once a worker says it took it over."""
        with reply:
            try:
                accepted = await reply.wait(WorkerReply, max(0.0, deadline - time.monotonic()), subjects.ROUTE)
            except BusError:
                return  # nobody took it (or the request's time is up, and the worker stops it itself)
        if isinstance(accepted, GenerateAccepted):
            log.info("unanswered_route_handed_over", request_id=request_id, worker_id=accepted.worker_id)
            with contextlib.suppress(Exception):
                await self._bus.publish(subjects.worker_inbox(accepted.worker_id),
                                        AbortRequest(request_id=request_id, reason="route_unanswered", stream_to=stream_to))

    async def _route(
        self, request_id: str, prepared: PreparedRequest, deadline: float, excluded: Sequence[str], produced: int,
        context: Context | None = None, hand_over: _HandOver | None = None,
    ) -> RouteDecision:
        """The balancer's decision; raises `ApiError`, `RouteUnanswered` when no balancer answered in time, or
        `NoBalancer` when none took the request."""
        route = RouteRequest(
            request_id=request_id,
            model=prepared.model,
            prompt_tokens=len(prepared.prompt_token_ids) + produced,
            max_tokens=prepared.sampling.max_tokens - produced,
            timeout_s=max(0.0, deadline - time.monotonic()),
            block_hashes=prepared.block_hashes,
            exclude_workers=list(excluded),
            priority=prepared.priority,
            tenant=prepared.tenant,
            tenant_weight=prepared.tenant_weight,
            prefix_token_ids=prepared.prompt_token_ids[: self._settings.forward_prefix_tokens],
            hand_over=hand_over.request if hand_over else None,
            adapter="" if prepared.adapter is None else prepared.adapter.name,
        )
        # The balancer may hold the request in its central queue, at most
        # `max_queue_wait_s` (then it answers 503 itself). No answer by then, or
        # the replica fell silent, means it went away holding it (`RequestFlight.on_unanswered` decides what then).
        timeout = self._settings.route_timeout_s + min(self._max_queue_wait_s, route.timeout_s)
        try:
            reply = await self._routes.ask(route, timeout, context)
        except NoResponders as exc:
            raise NoBalancer(str(exc)) from exc
        except RequestTimeout as exc:
            raise RouteUnanswered(str(exc)) from exc
        except BusError as exc:
            raise ApiError(503, f"routing failed: {exc}", code="balancer_unavailable", retry_after_s=1.0) from exc
        if isinstance(reply, ErrorReply):
            raise ApiError.from_reply(reply)
        return reply

    def _worker_request(
        self, request_id: str, prepared: PreparedRequest, decision: RouteDecision | None, stream: ReplyStream,
        deadline: float, produced: Sequence[int], accept_to: str = "",
    ) -> GenerateRequest | PrefillRequest:
        """What the chain's first node gets: a `PrefillRequest` naming the decode node for a two-node chain.
        `accept_to`: where a `GenerateRequest` is answered, when the balancer sends it on."""
        common = dict(
            request_id=request_id,
            model=prepared.model,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling=prepared.sampling,
            stream_to=stream.subject,
            timeout_s=max(0.0, deadline - time.monotonic()),
            resume_token_ids=list(produced),
            api=prepared.api,
            adapter=prepared.adapter,
        )
        if decision is not None and decision.prefill_inbox:
            return PrefillRequest(**common, decode_worker_id=decision.worker_id, decode_inbox=decision.inbox,
                                  prefix_tokens=decision.prefix_tokens)
        return GenerateRequest(**common, accept_to=accept_to)

    async def _hand_over(
        self, request_id: str, prepared: PreparedRequest, decision: RouteDecision, stream: ReplyStream,
        deadline: float, produced: Sequence[int], context: Context | None = None, hand_over: _HandOver | None = None,
    ) -> GenerateAccepted | str:
        """The chain's first node's acceptance; or, when it refused, its id (gone or draining: route again).

        Sends the chain's first node its request, unless the balancer sent it on already (`handed_over`);
        either way, waits for that node's answer.
        """
        first, inbox = (decision.prefill_worker_id, decision.prefill_inbox) if decision.prefill_inbox else (decision.worker_id, decision.inbox)
        timeout = self._settings.accept_timeout_s
        try:
            if decision.handed_over and hand_over is not None:
                reply = await hand_over.reply.wait(WorkerReply, timeout, inbox)
            else:
                request = self._worker_request(request_id, prepared, decision, stream, deadline, produced)
                reply = await self._bus.request(inbox, request, WorkerReply, timeout, context=context)
        except (NoResponders, RequestTimeout) as exc:
            log.warning("worker_unreachable", request_id=request_id, worker_id=first, error=str(exc))
            # Not the process that may answer under that id by now: the one the balancer chose.
            await self._report(first, "timeout", request_id, str(exc),
                               decision.started_at if first == decision.worker_id else 0.0)
            return first
        except BusError as exc:
            raise ApiError(502, f"bad reply from worker: {exc}", code="bad_gateway") from exc
        if isinstance(reply, ErrorReply):
            if reply.code in _RETRYABLE_WORKER_CODES:
                return first
            raise ApiError.from_reply(reply)
        return reply

    async def _relay(
        self, request_id: str, decision: RouteDecision, stream: ReplyStream, accepted: GenerateAccepted,
    ) -> AsyncIterator[TokenChunk | StreamEnd]:
        """Frames of one chain's stream; raises `StreamInterrupted` when it breaks off.

        The node that accepted the request runs it only as long as the process that accepted it lives: one
        heartbeating under its id with another start restarted, and the request went with the old process.
        """
        expected_seq = 0
        last_frame_at = time.monotonic()
        first_token_at: float | None = None
        tokens = 0
        check_every = self._settings.liveness_check_s
        decode = decision.worker_id
        # The prefill node answers for the request until it hands it over.
        prefill = decision.prefill_worker_id
        while True:
            try:
                frame = await stream.next(check_every)
            except RequestTimeout:
                now = time.monotonic()
                silent_for = now - last_frame_at
                for worker_id in (prefill, decode):
                    if not worker_id:
                        continue
                    started_at = self._live_start(worker_id)
                    if started_at is None:
                        raise StreamInterrupted(f"worker {worker_id} is gone", "timeout", worker_id, node_lost=True) from None
                    # Later only: a view that has not yet heard the process that accepted still shows the one before.
                    if worker_id == accepted.worker_id and started_at > accepted.started_at > 0:
                        raise StreamInterrupted(f"worker {worker_id} restarted", "timeout", worker_id, restarted=True) from None
                reconnected_at = self._bus.reconnected_at
                if reconnected_at is not None and last_frame_at < reconnected_at and now - reconnected_at > self._settings.reconnect_grace_s:
                    # Frames published while NATS was down are gone; resume rather than wait for the stall timeout.
                    raise StreamInterrupted("NATS reconnected and the stream went quiet", None) from None
                if silent_for >= self._settings.stall_timeout_s:
                    stalled = prefill or decode
                    raise StreamInterrupted(f"worker {stalled} stalled for {silent_for:.1f}s", "timeout", stalled) from None
                continue
            last_frame_at = time.monotonic()
            # Before the hand-off, errors come from the prefill node (about itself, or about its decode node).
            source = decode if not prefill or (isinstance(frame, ErrorReply) and frame.code == "decode_unavailable") else prefill
            match frame:
                case Handoff():
                    prefill = ""
                case ErrorReply(code="preempted"):
                    raise StreamInterrupted("preempted to make room", None, preempted=True)
                case ErrorReply(code="deadline_exceeded"):
                    # The request's own time ran out: no node is at fault, and resuming it leaves no time either.
                    raise ApiError.from_reply(frame)
                case ErrorReply(code="draining"):
                    # The node is leaving (drain timeout, dead engine), not at fault: resume elsewhere.
                    raise StreamInterrupted(f"worker {source} handed the request back: {frame.message}", None, source,
                                            handed_back=True)
                case ErrorReply(status=status) if status >= 500:
                    raise StreamInterrupted(f"worker {source} failed: {frame.message}", "error", source)
                case ErrorReply():
                    raise ApiError.from_reply(frame)
                case TokenChunk() | StreamEnd():
                    prefill = ""
                    if frame.seq != expected_seq:
                        raise StreamInterrupted(f"stream from {decode} lost frames", "error", decode)
                    expected_seq += 1
                    if isinstance(frame, TokenChunk):
                        tokens += len(frame.token_ids)
                        first_token_at = first_token_at or last_frame_at
                    yield frame
                    if isinstance(frame, StreamEnd):
                        await self._judge_speed(decode, request_id, first_token_at, last_frame_at, tokens, accepted)
                        return

    async def _judge_speed(self, worker_id: str, request_id: str, first: float | None, last: float, tokens: int,
                           accepted: GenerateAccepted) -> None:
        if first is None or tokens < 2:
            return
        if self._norms.observe(worker_id, (last - first) / (tokens - 1)):
            await self._report(worker_id, "slow", request_id, "inter-token latency far above this node's norm",
                               _start_of(worker_id, accepted))

    async def _abandon(
        self, request_id: str, stream_to: str, decision: RouteDecision, interruption: StreamInterrupted, accepted: GenerateAccepted,
        context: Context | None = None,
    ) -> None:
        # Free the slots the old attempt may still hold (a stalled worker that
        # wakes up, for instance), and tell the health-prober what happened.
        await self._abort(request_id, stream_to, decision, "migrated", context)
        if interruption.feedback is not None:
            culprit = interruption.culprit or decision.worker_id
            await self._report(culprit, interruption.feedback, request_id, interruption.reason, _start_of(culprit, accepted))

    async def _abort(self, request_id: str, stream_to: str, decision: RouteDecision, reason: str,
                     context: Context | None = None) -> None:
        """Stop the attempt that streams to `stream_to` on the chain's nodes; not a later attempt of the request."""
        abort = AbortRequest(request_id=request_id, reason=reason, stream_to=stream_to)
        for inbox in _inboxes(decision):
            with contextlib.suppress(Exception):
                await self._bus.publish(inbox, abort, context=context)

    async def _report(self, worker_id: str, kind: FeedbackKind, request_id: str, detail: str, started_at: float) -> None:
        """Tell the health-prober about the process of `worker_id` that started at `started_at` (0: not known)."""
        with contextlib.suppress(Exception):
            await self._bus.publish(subjects.FEEDBACK, NodeFeedback(worker_id, kind, request_id, detail[:200], started_at),
                                    traced=False)
