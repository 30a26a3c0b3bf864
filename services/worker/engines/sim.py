"""The sim engine's asyncio shell around the pure `SimScheduler`.

One task runs the scheduler: it takes a step, sleeps the step's simulated
duration (divided by `speed`), then hands each emitted token to its
request's queue, as a GPU would deliver a step's tokens when it ends.

Disaggregation: `prefill` runs the prompt and keeps its blocks until
`release_kv` (the worker's `KvHolds` calls it on release or expiry). A request with a `kv_ref` waits the
transfer time of its KV bytes over the configured link, then finds its
prompt in the prefix cache. Whether the source still holds the KV is the
worker's check (a pull over NATS) before it calls `generate`.

The OpenAI request surface (tools, structured outputs, logprobs, `n`) is
planned by `sim_api` from the request's body: a choice's scripted answer
rides in its `SimRequest`, so the scheduler alone decides what each step
emits; choice i > 0 of `n` runs as a request of its own, beside the first.

Fault injection: with `fail_after_tokens` the engine dies once it has
generated that many tokens, as a GPU engine dies under a worker: every
request, running or new, then fails with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import structlog

from contracts.messages import EngineStats, FinishReason, KvRef
from services.worker.engines.base import (
    EngineConfigError,
    EngineDeadError,
    EngineOutput,
    EngineRequest,
    KvCacheDelta,
    RequestRejected,
    check_fits,
    net_kv_delta,
)
from services.worker.sim.adapter_slots import AdapterSlots
from services.worker.engines.sim_api import SIM_TOOL_CALL_PARSERS, SimApiRun, plan_sim_request
from services.worker.sim import SimRequest, SimScheduler, StepOutcome, StepTimeProfile, get_profile
from shared.config import LoraSettings, SimSettings
from shared.kv.links import get_link
from shared.tokenizer import SimTokenizer

log = structlog.get_logger("kvlane.worker.sim")

# Put on every waiting request's queue when the engine dies.
_DEAD = object()
# Joins a request's id and a choice's index into the id choice i > 0 of `n` runs under in the scheduler.
_CHOICE_SEPARATOR = "\x1fchoice-"


def build_scheduler(settings: SimSettings, profile: StepTimeProfile, output_token_range: tuple[int, int],
                    lora: LoraSettings | None = None) -> SimScheduler:
    """The scheduler a sim worker runs for these settings (and the simulator runs per node)."""
    serves_adapters = lora is not None and lora.max_loras > 0
    return SimScheduler(
        num_blocks=settings.num_blocks,
        block_size=settings.block_size,
        max_num_seqs=settings.max_num_seqs,
        max_batched_tokens=settings.max_batched_tokens,
        profile=profile,
        output_token_range=output_token_range,
        record_kv_events=True,
        adapters=AdapterSlots(lora.max_loras, lora.max_cpu_loras) if serves_adapters else None,  # type: ignore[union-attr]
        adapter_activate_s=settings.adapter_activate_s,
        adapter_load_s=settings.adapter_load_s,
    )


class StepStats:
    """What a sim worker's heartbeat says: its scheduler's state, and token rates since the previous heartbeat."""

    def __init__(self, scheduler: SimScheduler, now: float) -> None:
        self._scheduler = scheduler
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._since = now

    def observe(self, outcome: StepOutcome) -> None:
        self._prefill_tokens += outcome.prefill_tokens
        self._decode_tokens += outcome.decode_seqs

    def take(self, now: float, kv_pulls: int = 0, kv_pull_bytes: int = 0, kv_pull_seconds: float = 0.0,
             external_hits: int = 0) -> EngineStats:
        s = self._scheduler.stats()
        elapsed = max(now - self._since, 1e-9)
        stats = EngineStats(
            running=s.running,
            waiting=s.waiting,
            prefilling=s.prefilling,
            kv_blocks_total=s.blocks_total,
            kv_blocks_used=s.blocks_used,
            prefix_query_tokens=s.prefix_query_tokens,
            prefix_hit_tokens=s.prefix_hit_tokens,
            preemptions=s.preemptions,
            prefill_tokens_per_s=self._prefill_tokens / elapsed,
            decode_tokens_per_s=self._decode_tokens / elapsed,
            gpu_utilization=None,
            kv_pulls=kv_pulls,
            kv_pull_bytes=kv_pull_bytes,
            kv_held_blocks=s.blocks_held,
            kv_pull_seconds=kv_pull_seconds,
            prefix_external_hit_tokens=external_hits,
            adapters_active=s.adapters_active,
            adapters_running=s.adapters_running,
            adapters_cached=s.adapters_cached,
            adapter_loads=s.adapter_loads,
            adapter_load_s=s.adapter_fetch_seconds / s.adapter_fetches if s.adapter_fetches else 0.0,
        )
        self._prefill_tokens = self._decode_tokens = 0
        self._since = now
        return stats


class SimEngine:
    def __init__(self, settings: SimSettings, tokenizer: SimTokenizer, clock: Callable[[], float] = time.monotonic,
                 lora: LoraSettings | None = None) -> None:
        self._settings = settings
        self._tokenizer = tokenizer
        self._clock = clock
        self._profile = get_profile(settings.profile)
        self._link = get_link(settings.kv_link)
        self._scheduler = build_scheduler(settings, self._profile, tokenizer.output_token_range, lora)
        if settings.tool_call_parser and settings.tool_call_parser not in SIM_TOOL_CALL_PARSERS:
            raise EngineConfigError(f"worker.sim.tool_call_parser {settings.tool_call_parser!r} is unknown "
                                    f"(known: {', '.join(SIM_TOOL_CALL_PARSERS)}; empty: none)")
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._step_stats = StepStats(self._scheduler, clock())
        self._kv_pulls = 0
        self._kv_pull_bytes = 0
        # Prompt tokens the pulls entered into this node's cache that it did not hold (`EngineStats.prefix_external_hit_tokens`).
        self._external_hits = 0
        self._kv_pull_seconds = 0.0
        self._tokens_generated = 0
        self._death: str | None = None

    @property
    def errored(self) -> bool:
        return self._death is not None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def check(self, request: EngineRequest) -> None:
        self._raise_if_dead()
        check_fits(request, self._settings.max_model_len, self._tokenizer.vocab_size)
        self._plan(request)

    def _seed(self, request: EngineRequest) -> int:
        return self._settings.seed if request.sampling.seed is None else request.sampling.seed

    def _plan(self, request: EngineRequest) -> SimApiRun | None:
        """How the request's API asks shape its answer; None for plain words (`RequestRejected` for what the sim cannot do)."""
        return plan_sim_request(request, self._seed(request), self._settings.tool_call_parser,
                                self._tokenizer.token_text, self._tokenizer.output_token_range)

    async def prefill(self, request: EngineRequest, source_worker_id: str, hold_s: float) -> KvRef:
        self.check(request)
        request_id = request.request_id
        self.release_kv(request_id)  # a retry of a request this node prefilled before
        # One token past what is known: the step that samples it has computed all the KV.
        known = len(request.resume_token_ids)
        queue = self._add(request, max_tokens=known + 1, hold_kv=True)
        finished = False
        cached_tokens = 0
        try:
            while not finished:
                _, finished, cached_tokens, _ = self._alive(await queue.get())
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._scheduler.abort(request_id)
        num_tokens = len(request.prompt_token_ids) + known
        return KvRef(
            source_worker_id=source_worker_id,
            engine_id=source_worker_id,
            request_id=request_id,
            num_tokens=num_tokens,
            hold_s=hold_s,
            kv_bytes=num_tokens * self._profile.kv_bytes_per_token,
            cached_tokens=cached_tokens,
        )

    def release_kv(self, request_id: str) -> None:
        if self._scheduler.release_held(request_id):
            self._wake.set()  # freed blocks may admit a waiting request

    async def _pull(self, ref: KvRef, token_ids: list[int]) -> None:
        started = self._clock()
        await asyncio.sleep(self._link.transfer_seconds(ref.kv_bytes) / self._settings.speed)
        pulled = token_ids[: ref.num_tokens]
        held = self._scheduler.cached_prefix_tokens(pulled)
        self._external_hits += max(0, self._scheduler.import_prefix(pulled) - held)
        self._kv_pulls += 1
        self._kv_pull_bytes += ref.kv_bytes
        self._kv_pull_seconds += self._clock() - started

    def _add(self, request: EngineRequest, max_tokens: int, hold_kv: bool = False, *, request_id: str = "",
             seed: int | None = None, script: list[int] | None = None, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """Queue `request` (or one of its choices: its own id, seed and script) in the scheduler; its outputs' queue."""
        self._raise_if_dead()  # it may have died during a KV pull
        request_id = request_id or request.request_id
        seed = self._seed(request) if seed is None else seed
        try:
            self._scheduler.add(SimRequest(request_id, request.prompt_token_ids, max_tokens, seed,
                                           request.resume_token_ids, hold_kv, script or [],
                                           "" if request.adapter is None else request.adapter.name))
        except ValueError as exc:
            raise RequestRejected(str(exc)) from exc
        queue = asyncio.Queue() if queue is None else queue
        self._queues[request_id] = queue
        self._wake.set()
        return queue

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self._raise_if_dead()
        check_fits(request, self._settings.max_model_len, self._tokenizer.vocab_size)
        run = self._plan(request)
        if run is not None:
            async for output in self._generate_planned(request, run):
                yield output
            return
        sampling = request.sampling
        if request.kv_ref is not None:
            await self._pull(request.kv_ref, request.prompt_token_ids + request.resume_token_ids)
        queue = self._add(request, sampling.max_tokens)
        stop = StopMatcher(sampling.stop)
        engine_finished = stopped = False
        try:
            while not (engine_finished or stopped):
                token_id, engine_finished, cached_tokens, _ = self._alive(await queue.get())
                text, stopped = stop.feed(self._tokenizer.token_text(token_id))
                if engine_finished and not stopped:
                    text += stop.flush()
                reason = "stop" if stopped else ("length" if engine_finished else None)
                if request.kv_ref is not None:  # pulled tokens were computed on the prefill node, not hit
                    cached_tokens = request.kv_ref.cached_tokens
                yield EngineOutput([token_id], text, reason, cached_tokens)
        finally:
            self._queues.pop(request.request_id, None)
            if not engine_finished:
                self._scheduler.abort(request.request_id)

    async def _generate_planned(self, request: EngineRequest, run: SimApiRun) -> AsyncIterator[EngineOutput]:
        """`generate` for a request the API shapes: each choice its own scheduler request, stop strings and
        finish; the request ends once every choice has."""
        sampling = request.sampling
        if request.kv_ref is not None:
            await self._pull(request.kv_ref, request.prompt_token_ids + request.resume_token_ids)
        ids = [request.request_id] + [f"{request.request_id}{_CHOICE_SEPARATOR}{c.index}" for c in run.choices[1:]]
        index_of = {request_id: index for index, request_id in enumerate(ids)}
        queue: asyncio.Queue = asyncio.Queue()
        running: set[str] = set()
        try:
            for request_id, choice in zip(ids, run.choices, strict=True):
                self._add(request, sampling.max_tokens, request_id=request_id, seed=choice.seed, script=choice.script,
                          queue=queue)
                running.add(request_id)
            stops = [StopMatcher(sampling.stop) for _ in ids]
            first_cached = 0
            while running:
                token_id, engine_finished, cached_tokens, request_id = self._alive(await queue.get())
                if request_id not in running:
                    continue  # a choice a stop string ended, whose step was under way
                index = index_of[request_id]
                stop = stops[index]
                text, stopped = stop.feed(self._tokenizer.token_text(token_id))
                reason: FinishReason | None = None
                if stopped:
                    reason = "stop"
                elif engine_finished:
                    text += stop.flush()
                    reason = "stop" if run.ends_script(index, 1) else "length"
                if index == 0:
                    first_cached = cached_tokens
                if request.kv_ref is not None:  # pulled tokens were computed on the prefill node, not hit
                    first_cached = request.kv_ref.cached_tokens
                if reason is not None:
                    running.discard(request_id)
                    self._queues.pop(request_id, None)
                    if not engine_finished:
                        self._scheduler.abort(request_id)
                yield run.output(index, [token_id], text, reason, stop.matched, first_cached)
        finally:
            for request_id in ids:
                self._queues.pop(request_id, None)
            for request_id in running:
                self._scheduler.abort(request_id)

    def drain_kv_events(self) -> KvCacheDelta:
        return net_kv_delta((e.kind == "stored", e.block_hash) for e in self._scheduler.drain_kv_events())

    def stats(self) -> EngineStats:
        return self._step_stats.take(self._clock(), self._kv_pulls, self._kv_pull_bytes, self._kv_pull_seconds,
                                     self._external_hits)

    async def _run(self) -> None:
        try:
            await self._step_loop()
        except Exception as exc:
            # A request the checks let through broke the scheduler: fail every request now, rather
            # than leave them all waiting for a step that never comes.
            log.exception("sim_step_failed")
            self._die(f"sim engine step failed: {type(exc).__name__}: {exc}")

    async def _step_loop(self) -> None:
        fail_after = self._settings.fail_after_tokens
        loop = asyncio.get_running_loop()
        step_end: float | None = None
        step_s = 0.0
        while True:
            if not self._scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                step_end = None
                continue
            # The profile's step time includes the engine's own scheduling work, so a step runs from the previous
            # one's due end, not from whenever this loop woke up: otherwise the scheduler's CPU and every late
            # wake-up are added to every step. A stall longer than a step is not made up for by shorter steps.
            now = loop.time()
            started = step_end if step_end is not None and now - step_end < step_s else now
            outcome = self._scheduler.step()
            stepped = dict(self._queues)
            step_s = outcome.duration_s / self._settings.speed
            step_end = started + step_s
            await asyncio.sleep(max(0.0, step_end - loop.time()))
            self._deliver(outcome, stepped)
            self._tokens_generated += len(outcome.emitted)
            if fail_after and self._tokens_generated >= fail_after:
                self._die(f"sim engine died after {self._tokens_generated} tokens (sim.fail_after_tokens)")
                return

    def _die(self, cause: str) -> None:
        log.error("sim_engine_died", cause=cause, running=len(self._queues))
        self._death = cause
        for queue in self._queues.values():
            queue.put_nowait(_DEAD)

    def _alive(self, item: object) -> tuple:
        if item is _DEAD:
            self._raise_if_dead()
        return item  # type: ignore[return-value]

    def _raise_if_dead(self) -> None:
        if self._death is not None:
            raise EngineDeadError(self._death)

    def _deliver(self, outcome: StepOutcome, stepped: dict[str, asyncio.Queue]) -> None:
        """Hand each request its token of the step; `stepped`: the requests' queues as the step began."""
        self._step_stats.observe(outcome)
        finished = {info.request_id: info.cached_prompt_tokens for info in outcome.finished_info}
        for request_id, token_id in outcome.emitted:
            queue = self._queues.get(request_id)
            if queue is None or queue is not stepped.get(request_id):
                continue  # aborted during the step; or since then added again, and the token is the earlier run's
            if request_id in finished:
                queue.put_nowait((token_id, True, finished[request_id], request_id))
            else:
                queue.put_nowait((token_id, False, self._scheduler.cached_prompt_tokens(request_id), request_id))


class StopMatcher:
    """Cuts generated text at the first stop string, across token boundaries.

    Text that could be the start of a stop string is held back until it is
    known not to be one, so a client never sees part of a stop string.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        # The stop string that was reached (vLLM's `stop_reason`).
        self.matched: str | None = None

    def feed(self, piece: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string was reached."""
        if not self._stops:
            return piece, False
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            self.stopped = True
            self.matched = min((s for s in self._stops if s in text), key=text.find)
            return text[:cut], True
        keep = max((self._partial_suffix(text, s) for s in self._stops), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Held-back text, released when generation ends without a stop string."""
        held, self._held = self._held, ""
        return held

    @staticmethod
    def _partial_suffix(text: str, stop: str) -> int:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if stop.startswith(text[-length:]):
                return length
        return 0
