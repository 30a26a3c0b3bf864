"""The worker: serves generate requests for one engine and keeps its node alive.

Requests arrive on the worker's own inbox subject. Each is answered at once
with `GenerateAccepted` (or an `ErrorReply`), then its frames are published
to the caller's stream subject. Every request ends with exactly one final
frame (`StreamEnd` or `ErrorReply`) and one `RequestFinished` event, from
the node that ended it.

Disaggregated chains: a prefill node takes `PrefillRequest`s, runs the
prompt, holds the KV and hands the request to the decode node (a
`GenerateRequest` with a `KvRef`); from then on the decode node owns it. A
decode node pulls the KV (`kv_pull_attempts` tries), else prefills itself.

Leaving: a drain (SIGTERM) takes no new request and lets running ones
finish; those still running at the drain timeout are handed back (a
`draining` error, 503), and ingress resumes them elsewhere after the tokens
already sent. If the engine dies, the worker leaves the cluster at once
(`WorkerLeft`, no more heartbeats), hands its requests back the same way,
and `engine_death` tells the process to exit for a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import structlog
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Tracer
from redis.exceptions import RedisError

from contracts import subjects
from contracts.messages import (
    AbortRequest,
    ErrorReply,
    GenerateAccepted,
    GenerateRequest,
    Handoff,
    KvEvents,
    KvRef,
    PrefillRequest,
    RequestFinished,
    RequestToRun,
    StreamEnd,
    Timings,
    TokenChunk,
    Usage,
    WorkerLeft,
    WorkerRegistration,
    WorkerReply,
    WorkerRequest,
)
from contracts.balancer import BalancerHeartbeat
from contracts.cache import LeaseProgress, RenewLeases
from contracts.model_files import AdapterRef
from services.worker.engines.base import (
    Engine,
    EngineOutput,
    EngineRequest,
    KvPullFailed,
    LocalAdapter,
    PushesOutputs,
    RequestRejected,
)
from services.worker.finished_replay import FinishedReplay
from services.worker.handoff import KvHolds, KvPuller
from services.worker.metrics import WorkerMetrics
from services.worker.tracing import FIRST_OUTPUT_EVENT, KvTransferSpan, end_request_span, kv_attributes, request_span
from shared.adapter_store import AdapterCache, AdapterError
from shared.bus import Bus, BusError
from shared.config import ClusterSettings, WorkerSettings
from shared.heartbeats import HeartbeatSender
from shared.periodic import Periodic
from shared.state import ClusterState
from shared.stream_outbox import StreamOutbox
from shared.telemetry import set_error

log = structlog.get_logger("kvlane.worker")

# Abort reasons whose request is resumed elsewhere by whoever streams it: they end with a 503, not a 499.
_HANDED_BACK_REASONS = ("preempted", "draining")
# How long requests get to end by themselves once the engine died (it fails them at once) before they are cancelled.
_ENGINE_DEATH_GRACE_S = 2.0


def _rejected(exc: RequestRejected) -> ErrorReply:
    return ErrorReply(code="invalid_request", message=str(exc), status=400, param=exc.param)


def _abort_reply(reason: str) -> ErrorReply:
    if reason in _HANDED_BACK_REASONS:
        return ErrorReply(code=reason, message=f"request {reason}: resume it elsewhere", status=503, retry_after_s=0)
    return ErrorReply(code=reason, message=f"request {reason}", status=499)


class WorkerService:
    def __init__(
        self,
        registration: WorkerRegistration,
        engine: Engine,
        bus: Bus,
        state: ClusterState,
        cluster: ClusterSettings,
        settings: WorkerSettings,
        metrics: WorkerMetrics | None = None,
        tracer: Tracer | None = None,
        adapters: AdapterCache | None = None,
    ) -> None:
        self.registration = registration
        # LoRA adapters fetched from the bus (None: the worker serves none).
        self._adapters = adapters
        self._tracer = tracer or trace.NoOpTracer()
        # What KV crosses from a prefill node to a decode node (span attribute).
        self._kv_link = settings.sim.kv_link if settings.engine == "sim" else "nixl"
        self._engine = engine
        self._engine_pushes = isinstance(engine, PushesOutputs)
        self._bus = bus
        self._state = state
        self._settings = settings
        # A prefill node, or a kv_share node as the source of a prefix pull, runs prompts for another node to pull.
        self._exposes_kv = registration.role == "prefill" or registration.kv_share
        self._holds = KvHolds(bus, registration.worker_id, engine.release_kv)
        self._puller = KvPuller(bus, registration.worker_id, settings.kv_pull_timeout_s)
        self._outbox = StreamOutbox(bus)
        self._kv_pull_failures = 0
        self._running: dict[str, asyncio.Task] = {}
        # Where each running request streams: an ingress's attempt (several attempts of one request share its id).
        self._streams: dict[str, str] = {}
        # Every attempt of a request not yet ended here, the running one last: the engine knows a request id once.
        self._attempts: dict[str, list[asyncio.Task]] = {}
        self.metrics = metrics or WorkerMetrics()
        self.metrics.count_in_flight(lambda: len(self._running))
        # Tokens generated so far per running request (lease renewals carry it).
        self._generated: dict[str, int] = {}
        # Why a run was cancelled, by its task (attempts of one request share its id).
        self._abort_reasons: dict[asyncio.Task, str] = {}
        self._draining = False
        # Why the engine died (None while it lives); set once, when the worker starts to leave.
        self._engine_death_cause: str | None = None
        self._left_after_engine_death = asyncio.Event()
        self._heartbeat_seq = 0
        self._heartbeats = HeartbeatSender(cluster.full_heartbeat_every)
        self._kv_seq = 0
        self._background = [
            Periodic("heartbeat", cluster.heartbeat_interval_s, self._send_heartbeat),
            # Batching at a short interval bounds the message rate however fast
            # the engine steps, and lets a batch carry net changes only.
            Periodic("kv-events", cluster.kv_events_interval_s, self._publish_kv_events),
            Periodic("lease-renewal", cluster.lease_renew_interval_s, self._renew_leases),
        ]
        self._log = log.bind(worker_id=registration.worker_id)
        # Finished events a restarted balancer missed, published to it again (services/worker/finished_replay.py).
        self._finished_replay = FinishedReplay(1.5 * cluster.heartbeat_interval_s)

    async def start(self) -> None:
        await self._engine.start()
        if self._exposes_kv:
            await self._holds.start()
        await self._bus.subscribe(subjects.BALANCER_HEARTBEAT_ALL, BalancerHeartbeat, self._on_balancer_heartbeat,
                                  traced=False, at_once=True)
        await self._bus.subscribe(self.registration.inbox, WorkerRequest, self._on_request)
        await self._send_heartbeat()
        for periodic in self._background:
            periodic.start()

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, let in-flight ones finish, then leave the cluster."""
        self._draining = True
        self._log.info("worker_draining", in_flight=len(self._running))
        # The draining heartbeat takes the node out of routing at once.
        await self._send_heartbeat()
        if self._running:
            done, pending = await asyncio.wait(list(self._running.values()), timeout=timeout_s)
            if pending:
                self._log.warning("drain_timeout_handed_back", handed_back=len(pending))
                await self._hand_back(pending)
        await self._stop_background()
        await self._outbox.close()  # the handed-back requests' last frames go before the node leaves
        await self._announce_left("drained")
        await self._bus.flush()
        self._holds.release_all()
        await self._engine.shutdown()

    @property
    def engine_dead(self) -> bool:
        return self._engine_death_cause is not None

    async def engine_death(self) -> str:
        """Wait until the engine died and the worker has left the cluster; why it died."""
        await self._left_after_engine_death.wait()
        assert self._engine_death_cause is not None
        return self._engine_death_cause

    def _check_engine(self) -> bool:
        """Whether the engine still lives; the first time it is found dead, the worker starts to leave."""
        if not self._engine.errored:
            return True
        if self._engine_death_cause is None:
            self._engine_death_cause = "the engine died"
            self._draining = True
            self._bus.spawn(self._leave_after_engine_death())
        return False

    async def _leave_after_engine_death(self) -> None:
        self._log.error("engine_died_leaving", in_flight=len(self._running))
        try:
            # Out of every view first: nothing more is routed here, and a supervisor may restart the process.
            await self._stop_background()
            await self._announce_left("engine_dead")
            if self._running:
                # The dead engine fails its requests at once (each is handed back as it ends);
                # any not in the engine (a KV pull, a hand-off) is cancelled and handed back.
                _, pending = await asyncio.wait(list(self._running.values()), timeout=_ENGINE_DEATH_GRACE_S)
                if pending:
                    await self._hand_back(pending)
            await self._outbox.close()
            await self._bus.flush()
            self._holds.release_all()
            await self._engine.shutdown()
        except Exception:
            self._log.exception("leaving_after_engine_death_failed")
        finally:
            # Whatever went wrong above, the process must still exit for its restart.
            self._left_after_engine_death.set()

    async def _hand_back(self, tasks: set[asyncio.Task]) -> None:
        """Cancel these running requests, each ending with a `draining` error that sends it elsewhere."""
        for task in tasks:
            self._abort_reasons.setdefault(task, "draining")
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_background(self) -> None:
        await asyncio.gather(*(periodic.stop() for periodic in self._background))

    async def _announce_left(self, reason: str) -> None:
        worker_id = self.registration.worker_id
        # Redis first: a process that re-reads it after hearing `WorkerLeft` must not find the node again.
        with contextlib.suppress(RedisError, OSError):
            await self._state.remove_node(worker_id)
        with contextlib.suppress(Exception):
            await self._bus.publish(subjects.WORKER_LEFT, WorkerLeft(worker_id=worker_id, reason=reason))

    @property
    def in_flight(self) -> int:
        return len(self._running)

    # --- requests -----------------------------------------------------------------

    async def _on_request(self, message: WorkerRequest, msg: Msg) -> GenerateAccepted | ErrorReply | None:
        match message:
            case GenerateRequest(accept_to=accept_to) if accept_to:
                # A balancer sent it on: the ingress waits for the answer there.
                await self._bus.publish(accept_to, self._accept(message), traced=False)
                return None
            case GenerateRequest() | PrefillRequest():
                return self._accept(message)
            case AbortRequest(request_id=request_id, stream_to=stream_to):
                task = self._running.get(request_id)
                if task is None or (stream_to and stream_to != self._streams.get(request_id)):
                    # It ended here before the abort came, never ran here, or what runs is a later attempt.
                    self._log.debug("abort_of_no_running_request", request_id=request_id, reason=message.reason)
                    return None
                self._log.info("request_aborted", request_id=request_id, reason=message.reason)
                self._abort_reasons[task] = message.reason
                # Soon, not now: a task cancelled before its first step never runs its body, so
                # it would end without its final frame and RequestFinished (the slot and lease
                # would stay taken). Its first step is already scheduled, and runs first.
                asyncio.get_running_loop().call_soon(task.cancel)
                return None

    def _accept(self, request: RequestToRun) -> GenerateAccepted | ErrorReply:
        reply = self._admit(request)
        if isinstance(reply, ErrorReply) and reply.code not in ("draining", "duplicate_request"):
            # A refusal ends the request: the balancer and the cache-manager free
            # its slot and lease now rather than at their deadline. (A draining
            # refusal is routed again; a duplicate is still running.)
            self._bus.spawn(self._publish_finished(request, "error", 0, 0, 0.0))
        return reply

    def _admit(self, request: RequestToRun) -> GenerateAccepted | ErrorReply:
        if isinstance(request, PrefillRequest) and not self._exposes_kv:
            return ErrorReply(code="not_a_prefill_node", message=f"worker {self.registration.worker_id} is {self.registration.role}", status=503)
        if self._draining or not self._check_engine():
            return ErrorReply(code="draining", message="worker is draining", status=503, retry_after_s=0)
        if request.model != self.registration.model:
            return ErrorReply(code="model_not_found", message=f"this worker serves {self.registration.model!r}", status=404)
        if request.adapter is not None and self.registration.role != "aggregated":
            return ErrorReply(code="invalid_request", message="LoRA adapters run on aggregated workers only", status=400,
                              param="model")
        earlier = self._running.get(request.request_id)
        if earlier is not None and self._streams.get(request.request_id) == request.stream_to:
            return ErrorReply(code="duplicate_request", message=f"request {request.request_id} is already running", status=409)
        if request.timeout_s <= 0:
            return ErrorReply(code="deadline_exceeded", message="deadline passed before the worker got the request", status=504)
        # The sender's time left, as a moment on this host's own clock (the sender's clock may be off).
        received = time.monotonic()
        deadline = received + request.timeout_s
        kv_ref = request.kv_ref if isinstance(request, GenerateRequest) else None
        prompt, resumed = request.prompt_token_ids, request.resume_token_ids
        if isinstance(request, PrefillRequest) and 0 < request.prefix_tokens < len(prompt):
            # A prefix pull's source: only the prefix, whose KV the decode node pulls; it computes the rest.
            prompt, resumed = prompt[: request.prefix_tokens], []
        engine_request = EngineRequest(request.request_id, prompt, request.sampling, resumed, kv_ref,
                                       kv_held_until=None if kv_ref is None else received + kv_ref.hold_s, api=request.api)
        try:
            self._engine.check(engine_request)
        except RequestRejected as exc:
            return _rejected(exc)
        if earlier is not None:
            # The same request for another stream: the ingress asked again (no balancer answered it in time, or
            # it resumes it) and no longer reads the earlier attempt's stream, which gives way to this one.
            # It publishes no `RequestFinished`: the request goes on here, and its slot and lease (held under its id)
            # are the later attempt's now.
            self._log.info("request_superseded", request_id=request.request_id)
            self._abort_reasons[earlier] = "superseded"
            asyncio.get_running_loop().call_soon(earlier.cancel)  # soon: see the abort above
        request_id = request.request_id
        earlier_attempts = self._attempts.get(request_id, [])
        run = self._run if isinstance(request, GenerateRequest) else self._run_prefill
        task = asyncio.create_task(run(request, engine_request, deadline, after=list(earlier_attempts)))  # type: ignore[arg-type]
        self._running[request_id], self._streams[request_id] = task, request.stream_to
        self._attempts[request_id] = [*earlier_attempts, task]

        def forget(done: asyncio.Task) -> None:
            attempts = self._attempts[request_id]
            attempts.remove(done)
            if not attempts:
                del self._attempts[request_id]
            if self._running.get(request_id) is done:  # not an attempt that a later one superseded
                del self._running[request_id], self._streams[request_id]

        task.add_done_callback(forget)
        return GenerateAccepted(request_id=request.request_id, worker_id=self.registration.worker_id,
                                started_at=self.registration.started_at)

    async def _run(self, request: GenerateRequest, engine_request: EngineRequest, deadline: float,
                   after: list[asyncio.Task] | None = None) -> None:
        """Run `request` here until it ends or `deadline` (on `time.monotonic`'s clock) passes; not before
        the earlier attempts of it (`after`) have ended."""
        started = time.monotonic()
        first_token_at: float | None = None
        seq = cached_tokens = 0
        completion_tokens = len(request.resume_token_ids)
        outcome: str = "error"
        send = self._outbox.put
        # The request's `decode` span is current while it runs here: a KV pull's messages descend from it.
        span = request_span(self._tracer, "decode", self.registration, request)
        trace_token = otel_context.attach(trace.set_span_in_context(span))
        failure: str | None = None
        request_id, stream_to, generated = request.request_id, request.stream_to, self._generated

        def on_output(output: EngineOutput) -> None:
            nonlocal first_token_at, seq, completion_tokens, cached_tokens, outcome
            if first_token_at is None:
                first_token_at = time.monotonic()
                span.add_event(FIRST_OUTPUT_EVENT)
            completion_tokens += len(output.token_ids)
            generated[request_id] = completion_tokens
            cached_tokens = output.cached_tokens
            if request.api is not None or output.index or output.logprobs:
                send(stream_to, TokenChunk(request_id, seq, output.token_ids, output.text, output.index, output.logprobs, output.delta,
                                           output.finish_reason, output.stop_reason, output.parsed, output.prompt_logprobs))
            else:  # plain text: the chunk's trailing fields stay off the wire
                send(stream_to, TokenChunk(request_id, seq, output.token_ids, output.text))
            seq += 1
            if output.finish_reason is not None:
                outcome = output.finish_reason

        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                if after:
                    await asyncio.wait(after)
                if request.adapter is not None:
                    engine_request = await self._with_adapter(engine_request, request.adapter)
                await self._stream(engine_request, on_output)
            usage = Usage(len(request.prompt_token_ids), completion_tokens, cached_tokens)
            timings = Timings(first_token_s=None if first_token_at is None else first_token_at - started, finished_s=time.monotonic() - started)
            send(request.stream_to, StreamEnd(request.request_id, seq, outcome, usage, timings, self.registration.worker_id))
        except TimeoutError:
            outcome, failure = "error", "deadline_exceeded"
            send(request.stream_to, ErrorReply(code="deadline_exceeded", message="request deadline passed", status=504))
        except RequestRejected as exc:
            outcome, failure = "error", "invalid_request"
            send(request.stream_to, _rejected(exc))
        except AdapterError as exc:
            outcome, failure = "error", "adapter_unavailable"
            self._log.warning("adapter_unavailable", request_id=request.request_id, error=str(exc))
            send(request.stream_to, ErrorReply(code="adapter_unavailable", message=str(exc), status=exc.status, param="model"))
        except asyncio.CancelledError:
            outcome = "abort"
            reason = self._abort_reasons.get(asyncio.current_task(), "aborted")
            span.set_attribute("kvlane.abort_reason", reason)
            send(request.stream_to, _abort_reply(reason))
        except Exception as exc:
            if self._check_engine():
                outcome, failure = "error", "engine_error"
                self._log.exception("request_failed", request_id=request.request_id)
                send(request.stream_to, ErrorReply(code="engine_error", message=f"{type(exc).__name__}: {exc}", status=500))
            else:
                outcome = "abort"
                span.set_attribute("kvlane.abort_reason", "draining")
                send(request.stream_to, _abort_reply("draining"))
        finally:
            end_request_span(span, outcome, failure, completion_tokens, cached_tokens)
            otel_context.detach(trace_token)
            self._generated.pop(request.request_id, None)
            if self._abort_reasons.pop(asyncio.current_task(), None) != "superseded":  # type: ignore[arg-type]
                await self._publish_finished(request, outcome, completion_tokens, cached_tokens, time.monotonic() - started)

    async def _with_adapter(self, request: EngineRequest, adapter: AdapterRef) -> EngineRequest:
        """`request` with its LoRA adapter's files here, fetched from the bus on the adapter's first use."""
        if self._adapters is None:
            raise RequestRejected(f"this worker serves no LoRA adapter, and {adapter.name} is one", param="model")
        directory = await self._adapters.local(adapter)
        return msgspec.structs.replace(request, adapter=LocalAdapter(adapter.name, str(directory)))

    async def _stream(self, request: EngineRequest, on_output: Callable[[EngineOutput], None]) -> None:
        """Hand every output of `request` to `on_output`; return once the engine ended it."""
        if request.kv_ref is None and self._engine_pushes:
            # Straight from the engine's output loop: no task wakes per output.
            await self._engine.stream(request, on_output)  # type: ignore[attr-defined]
            return
        # aclosing: however the loop ends, the engine's generator is closed now, which
        # aborts the request in the engine (not whenever the garbage collector gets to it).
        async with contextlib.aclosing(self._outputs(request)) as outputs:
            async for output in outputs:
                on_output(output)
                if (output.finish_reason is None and asyncio.current_task() in self._abort_reasons
                        and asyncio.current_task().cancelling()):
                    # Cancelled, yet still running: a library swallowed the cancellation.
                    # Not before the cancel has landed: raising early, its late arrival
                    # could cut short the RequestFinished published below.
                    raise asyncio.CancelledError

    def _outputs(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """The engine's outputs; with a `kv_ref`, pulled KV first, else (pull failed) a local prefill."""
        if request.kv_ref is None:
            # The engine's own iterator: no generator in between to resume for every output.
            return self._engine.generate(request)
        return self._outputs_on_pulled_kv(request)

    async def _outputs_on_pulled_kv(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        ref = request.kv_ref
        assert ref is not None
        released = False
        transfer = KvTransferSpan(self._tracer, ref, self._kv_link)
        try:
            for attempt in range(1, self._settings.kv_pull_attempts + 1):
                produced = False
                pull_started = time.monotonic()
                try:
                    await self._puller.pull(request.request_id, ref, request.kv_held_until)
                    async with contextlib.aclosing(self._engine.generate(request)) as outputs:
                        async for output in outputs:
                            if not produced:
                                self.metrics.kv_first_token.observe(time.monotonic() - pull_started)
                                produced = released = True
                                transfer.done("pulled", attempt)
                                # The KV is here now: the source may free it.
                                self._bus.spawn(self._puller.release(request.request_id, ref))
                            yield output
                    return
                except KvPullFailed as exc:
                    if produced:
                        raise
                    self._kv_pull_failures += 1
                    self._log.warning("kv_pull_failed", request_id=request.request_id, attempt=attempt, error=str(exc))
                    transfer.pull_failed(attempt, str(exc))
            transfer.done("recomputed", self._settings.kv_pull_attempts, "kv_pull_failed")
            async with contextlib.aclosing(self._engine.generate(msgspec.structs.replace(request, kv_ref=None))) as outputs:
                async for output in outputs:
                    yield output
        finally:
            transfer.done("aborted", 0)  # unless it ended above
            if not released:
                self._bus.spawn(self._puller.release(request.request_id, ref))

    async def _run_prefill(self, request: PrefillRequest, engine_request: EngineRequest, deadline: float,
                           after: list[asyncio.Task] | None = None) -> None:
        """Prefill, hand over to the decode node; a failure before that ends the request here. Not before
        the earlier attempts of it (`after`) have ended."""
        started = time.monotonic()
        handed_off = False
        outcome = "error"
        error: ErrorReply | None = None
        # The `prefill` span; the decode node's spans descend from its `kv.handoff` child.
        span = request_span(self._tracer, "prefill", self.registration, request)
        trace_token = otel_context.attach(trace.set_span_in_context(span))
        try:
            async with asyncio.timeout(deadline - time.monotonic()):
                if after:
                    await asyncio.wait(after)
                ref = await self._engine.prefill(engine_request, self.registration.worker_id, self._settings.kv_hold_timeout_s)
                self._holds.hold(request.request_id, ref)
                handoff_attributes = {**kv_attributes(ref, self._kv_link), "kvlane.decode_worker.id": request.decode_worker_id,
                                      "kvlane.kv.cached_tokens": ref.cached_tokens}
                span.set_attributes(handoff_attributes)
                with self._tracer.start_as_current_span("kv.handoff", attributes=handoff_attributes) as handoff_span:
                    error = await self._hand_to_decode(request, ref, deadline)
                    if error is not None:
                        set_error(handoff_span, error.code, error.message)
            if error is None:
                handed_off = True
                handoff = Handoff(request.request_id, self.registration.worker_id, request.decode_worker_id, ref.num_tokens)
                with contextlib.suppress(Exception):
                    await self._bus.publish(request.stream_to, handoff)
        except TimeoutError:
            error = ErrorReply(code="deadline_exceeded", message="request deadline passed", status=504)
        except RequestRejected as exc:
            error = ErrorReply(code="invalid_request", message=str(exc), status=400)
        except asyncio.CancelledError:
            outcome = "abort"
            reason = self._abort_reasons.get(asyncio.current_task(), "aborted")
            span.set_attribute("kvlane.abort_reason", reason)
            error = _abort_reply(reason)
        except Exception as exc:
            if self._check_engine():
                self._log.exception("prefill_failed", request_id=request.request_id)
                error = ErrorReply(code="engine_error", message=f"{type(exc).__name__}: {exc}", status=500)
            else:
                outcome = "abort"
                span.set_attribute("kvlane.abort_reason", "draining")
                error = _abort_reply("draining")
        finally:
            failed = None if handed_off or outcome == "abort" or error is None else error.code
            end_request_span(span, "handed_off" if handed_off else outcome, failed)
            otel_context.detach(trace_token)
            superseded = self._abort_reasons.pop(asyncio.current_task(), None) == "superseded"  # type: ignore[arg-type]
            self.metrics.handoffs.labels("handed_off" if handed_off else "failed").inc()
            if not handed_off:
                self._holds.release(request.request_id)
                if error is not None:
                    with contextlib.suppress(Exception):
                        await self._bus.publish(request.stream_to, error)
                if not superseded:
                    await self._publish_finished(request, outcome, 0, 0, time.monotonic() - started)

    async def _hand_to_decode(self, request: PrefillRequest, ref: KvRef, deadline: float) -> ErrorReply | None:
        """Give the request to its decode node; the error to end it with if that fails."""
        fields = {name: getattr(request, name) for name in RequestToRun.__struct_fields__}
        # What is left now of the request's time and of the hold, not what was left when they began.
        fields["timeout_s"] = max(0.0, deadline - time.monotonic())
        ref = msgspec.structs.replace(ref, hold_s=self._holds.time_left(request.request_id))
        generate = GenerateRequest(**fields, kv_ref=ref)
        decode = request.decode_worker_id
        try:
            reply = await self._bus.request(request.decode_inbox, generate, WorkerReply, self._settings.handoff_timeout_s)
        except BusError as exc:
            return ErrorReply(code="decode_unavailable", message=f"decode node {decode} unreachable: {exc}", status=503)
        if isinstance(reply, ErrorReply):
            if reply.status >= 500:
                return ErrorReply(code="decode_unavailable", message=f"decode node {decode} refused: {reply.message}", status=503)
            return reply
        return None

    async def _publish_finished(self, request: RequestToRun, outcome: str, completion_tokens: int,
                                cached_tokens: int, duration_s: float) -> None:
        self.metrics.finished.labels(outcome).inc()
        finished = RequestFinished(
            request_id=request.request_id,
            worker_id=self.registration.worker_id,
            finish_reason=outcome,  # type: ignore[arg-type]
            usage=Usage(len(request.prompt_token_ids), completion_tokens, cached_tokens),
            duration_s=duration_s,
        )
        with contextlib.suppress(Exception):
            await self._bus.publish(subjects.REQUEST_FINISHED, finished)
        self._finished_replay.published(finished, time.monotonic())

    def _on_balancer_heartbeat(self, heartbeat: BalancerHeartbeat, msg: Msg) -> None:
        missed = self._finished_replay.heard(heartbeat, time.monotonic())
        if missed:
            self._log.info("finished_published_again", balancer_id=heartbeat.balancer_id, events=len(missed))
            self._bus.spawn(self._publish_again(missed))

    async def _publish_again(self, events: list[RequestFinished]) -> None:
        for event in events:
            with contextlib.suppress(Exception):
                await self._bus.publish(subjects.REQUEST_FINISHED, event, traced=False)

    # --- heartbeats ---------------------------------------------------------------

    async def _renew_leases(self) -> None:
        if not self._running:
            return
        leases = [LeaseProgress(rid, self._generated.get(rid, 0)) for rid in self._running]
        try:
            await self._bus.publish(subjects.CACHE_RENEW, RenewLeases(self.registration.worker_id, leases), traced=False)
        except Exception as exc:
            self._log.warning("lease_renew_failed", error=str(exc))

    async def _publish_kv_events(self) -> None:
        delta = self._engine.drain_kv_events()
        if not delta:
            return
        self._kv_seq += 1
        events = KvEvents(
            worker_id=self.registration.worker_id,
            seq=self._kv_seq,
            block_size=self.registration.block_size,
            stored=delta.stored,
            removed=delta.removed,
            cleared=delta.cleared,
        )
        try:
            await self._bus.publish(subjects.kv_events(self.registration.worker_id), events, traced=False)
        except Exception as exc:
            self._log.warning("kv_events_publish_failed", error=str(exc))

    async def _send_heartbeat(self) -> None:
        if not self._check_engine():
            return  # a dead engine's node leaves instead
        self._heartbeat_seq += 1
        stats = self._engine.stats()
        if self.registration.max_loras:
            self.metrics.adapters(self.registration.worker_id, self.registration.max_loras, stats.adapters_active)
        if self._kv_pull_failures:
            stats = msgspec.structs.replace(stats, kv_pull_failures=stats.kv_pull_failures + self._kv_pull_failures)
        # Redis keeps the full heartbeat; the bus gets the load alone unless the registration is due.
        heartbeat, on_wire = self._heartbeats.beat(self.registration, stats, time.time(), self._heartbeat_seq, self._draining)
        try:
            await self._bus.publish(subjects.heartbeat(self.registration.worker_id), on_wire, traced=False)
        except Exception as exc:  # NATS down: Redis still carries the heartbeat
            self._log.warning("heartbeat_publish_failed", error=str(exc))
        try:
            await self._state.put_heartbeat(heartbeat)
        except (RedisError, OSError) as exc:
            self._log.warning("heartbeat_store_failed", error=str(exc))
