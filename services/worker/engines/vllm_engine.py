"""The vLLM engine: vLLM v1 `AsyncLLM` embedded in the worker process.

* Prompts go in as token ids (`TokensPrompt`): ingress tokenized them with
  the model directory's own tokenizer, so the engine sees exactly what
  kvlane counted, hashed and routed on.
* Outputs come back as deltas (`RequestOutputKind.DELTA`): each carries the
  new token ids and the new text; vLLM applies stop strings itself.
* Closing the iterator early closes vLLM's generator, which aborts the
  request inside the engine and frees its KV blocks.
* Stats arrive through vLLM's stat-logger interface (called in this
  process's event loop for every engine-core step); KV events through a
  ZMQ SUB socket that this process binds and vLLM's publisher connects to,
  so no event is published before anyone listens.

Named `vllm_engine` so that it never shadows the `vllm` package.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable

import msgspec
import structlog
import zmq
from vllm import SamplingParams as VllmSamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from contracts.messages import EngineStats, FinishReason, SamplingParams
from services.worker.engines.base import (
    EngineConfigError,
    EngineOutput,
    EngineRequest,
    KvCacheDelta,
    RequestRejected,
    check_fits,
    net_kv_delta,
)
from services.worker.engines.kv_rehash import KvEventRehasher
from services.worker.engines.vllm_preflight import ResolvedEngine
from shared.config import VllmSettings

log = structlog.get_logger("kvlane.worker.vllm")

KV_EVENTS_TOPIC = "kv-events"


class StepCounters:
    """What the heartbeat reports, folded from vLLM's per-step stats (pure)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = self.prefix_hits = self.preemptions = 0
        self._prefill_tokens = self._decode_tokens = 0
        self._rate_since = clock()

    def on_step(self, scheduler_stats, iteration_stats) -> None:
        if scheduler_stats is not None:
            self.running = scheduler_stats.num_running_reqs
            self.waiting = scheduler_stats.num_waiting_reqs
            self.kv_usage = scheduler_stats.kv_cache_usage
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:  # per-step increments, not totals
                self.prefix_queries += prefix.queries
                self.prefix_hits += prefix.hits
        if iteration_stats is not None:
            self._prefill_tokens += iteration_stats.prompt_token_stats.computed
            self._decode_tokens += iteration_stats.num_generation_tokens
            self.preemptions += iteration_stats.num_preempted_reqs

    def take_rates(self) -> tuple[float, float]:
        """Prefill and decode tokens per second since the previous call."""
        now = self._clock()
        elapsed = max(now - self._rate_since, 1e-9)
        rates = self._prefill_tokens / elapsed, self._decode_tokens / elapsed
        self._prefill_tokens = self._decode_tokens = 0
        self._rate_since = now
        return rates


def _stat_logger_factory(counters: StepCounters):
    """A vLLM stat-logger factory feeding `counters` (vLLM calls it with the engine config)."""

    class CountersLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            counters.on_step(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return CountersLogger


def to_vllm_sampling(sampling: SamplingParams) -> VllmSamplingParams:
    return VllmSamplingParams(
        n=1,  # ingress rejects n > 1
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=0 if sampling.top_k in (-1, 0) else sampling.top_k,  # 0 disables top-k in vLLM
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
    )


def _finish_reason(vllm_reason: str | None) -> FinishReason | None:
    if vllm_reason is None:
        return None
    if vllm_reason in ("stop", "length", "abort"):
        return vllm_reason  # type: ignore[return-value]
    raise RuntimeError(f"vLLM finished the request with {vllm_reason!r}")


def _root_cause(exc: BaseException) -> str:
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return f"{type(exc).__name__}: {exc}"


class GpuProbe:
    """GPU utilisation from NVML when there is a GPU and pynvml; None otherwise (never 0 for "unknown")."""

    def __init__(self) -> None:
        self._nvml = self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # no pynvml, no driver, no GPU: all mean "not known"
            self._nvml = None

    def utilization(self) -> float | None:
        if self._nvml is None:
            return None
        try:
            return self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
        except Exception:
            return None


class KvEventSubscriber:
    """Receives vLLM's KV event batches on a ZMQ SUB socket, without blocking.

    vLLM's publisher binds an ipc:// path private to this worker (a
    filesystem socket: nothing off this host can reach it) and the SUB
    connects to it at once; ZMQ retries the connection until the engine
    binds, so the subscription is in place before the first request runs.
    """

    def __init__(self, rehasher: KvEventRehasher) -> None:
        self._rehasher = rehasher
        self._directory = tempfile.mkdtemp(prefix="kvlane-kv-events-")
        self.endpoint = f"ipc://{self._directory}/publisher.sock"
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Generous: a batch dropped here leaves the prefix index wrong.
        self._socket.setsockopt(zmq.RCVHWM, 100_000)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, KV_EVENTS_TOPIC)
        self._socket.connect(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._last_seq: int | None = None

    def poll(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                log.warning("kv_event_frame_malformed", frames=len(frames))
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if self._last_seq is not None and seq != self._last_seq + 1:
                log.warning("kv_events_missed", expected=self._last_seq + 1, got=seq)
            self._last_seq = seq
            try:
                batch = self._decoder.decode(payload)
            except msgspec.DecodeError as exc:
                log.warning("kv_event_batch_undecodable", error=str(exc))
                continue
            for event in batch.events:
                match event:
                    case BlockStored():
                        # LoRA, multimodal or salted blocks hash differently from plain tokens.
                        if event.lora_name is None and not any(event.extra_keys or ()):
                            self._rehasher.stored(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
                    case BlockRemoved():
                        self._rehasher.removed(event.block_hashes)
                    case AllBlocksCleared():
                        self._rehasher.all_cleared()

    def close(self) -> None:
        self._socket.close(linger=0)
        shutil.rmtree(self._directory, ignore_errors=True)


class VllmEngine:
    def __init__(self, settings: VllmSettings, resolved: ResolvedEngine, served_model_name: str) -> None:
        self._settings = settings
        self._resolved = resolved
        self._served_model_name = served_model_name
        self._counters = StepCounters()
        self._rehasher = KvEventRehasher(resolved.block_size)
        self._kv_events: KvEventSubscriber | None = None
        self._gpu = GpuProbe()
        self._engine: AsyncLLM | None = None
        self._kv_blocks_total = 0

    def engine_args(self, kv_events_endpoint: str) -> AsyncEngineArgs:
        settings = self._settings
        args: dict = dict(
            model=str(self._resolved.shape.directory),
            served_model_name=self._served_model_name,
            dtype=settings.dtype,
            max_model_len=self._resolved.max_model_len,
            block_size=settings.block_size,
            enable_prefix_caching=settings.enable_prefix_caching,
            tensor_parallel_size=settings.tensor_parallel_size,
            kv_events_config={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": kv_events_endpoint,
                "topic": KV_EVENTS_TOPIC,
            },
            disable_log_stats=False,  # the stat loggers feed the heartbeat
        )
        if self._resolved.kv_cache_bytes is not None:
            args["kv_cache_memory_bytes"] = self._resolved.kv_cache_bytes
        args.update(settings.extra_engine_args)
        return AsyncEngineArgs(**args)

    async def start(self) -> None:
        # vLLM's CPU platform lets this legacy variable override
        # kv_cache_memory_bytes; preflight already folded it into the size.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self._kv_events = KvEventSubscriber(self._rehasher)
        try:
            args = self.engine_args(self._kv_events.endpoint)
            self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self._counters)])
        except Exception as exc:
            # vLLM has logged the details; the worker stops with one line naming the cause.
            raise EngineConfigError(f"vLLM engine failed to start: {_root_cause(exc)}") from exc
        self._kv_blocks_total = self._engine.vllm_config.cache_config.num_gpu_blocks or 0
        log.info("vllm_engine_started", model=self._served_model_name, kv_blocks=self._kv_blocks_total,
                 block_size=self._resolved.block_size, max_model_len=self._resolved.max_model_len)

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._kv_events is not None:
            self._kv_events.close()
            self._kv_events = None

    def check(self, request: EngineRequest) -> None:
        check_fits(request, self._resolved.max_model_len, self._resolved.shape.vocab_size)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        self.check(request)
        if self._engine is None:
            raise RuntimeError("the vLLM engine is not running")
        # A resumed request replays what it already produced as prompt and
        # generates the rest (greedy decoding continues exactly).
        resumed = list(request.resume_token_ids)
        sampling = msgspec.structs.replace(request.sampling, max_tokens=request.sampling.max_tokens - len(resumed))
        outputs = self._engine.generate(
            TokensPrompt(prompt_token_ids=list(request.prompt_token_ids) + resumed),
            to_vllm_sampling(sampling),
            request.request_id,
        )
        # aclosing: an early close (client gone, deadline) closes vLLM's
        # generator, whose GeneratorExit handler aborts the request.
        async with contextlib.aclosing(outputs):
            try:
                async for output in outputs:
                    completion = output.outputs[0]
                    yield EngineOutput(
                        token_ids=list(completion.token_ids),
                        text=completion.text,
                        finish_reason=_finish_reason(completion.finish_reason) if output.finished else None,
                        cached_tokens=output.num_cached_tokens or 0,
                    )
            except (VLLMClientError, ValueError) as exc:
                raise RequestRejected(str(exc)) from exc

    def drain_kv_events(self) -> KvCacheDelta:
        if self._kv_events is None:
            return KvCacheDelta()
        self._kv_events.poll()
        events, cleared = self._rehasher.drain()
        return net_kv_delta(events, cleared)

    def stats(self) -> EngineStats:
        counters = self._counters
        prefill_rate, decode_rate = counters.take_rates()
        # vLLM sends scheduler stats with step outputs only, so once its last
        # request finished or was aborted, its last report may still count it;
        # the front end's own count of unfinished requests is current.
        idle = self._engine is None or self._engine.get_num_unfinished_requests() == 0
        return EngineStats(
            running=0 if idle else counters.running,
            waiting=0 if idle else counters.waiting,
            kv_blocks_total=self._kv_blocks_total,
            kv_blocks_used=round(counters.kv_usage * self._kv_blocks_total),
            prefix_query_tokens=counters.prefix_queries,
            prefix_hit_tokens=counters.prefix_hits,
            preemptions=counters.preemptions,
            prefill_tokens_per_s=prefill_rate,
            decode_tokens_per_s=decode_rate,
            gpu_utilization=self._gpu.utilization(),
        )
