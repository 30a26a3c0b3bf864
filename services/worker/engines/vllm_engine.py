"""The vLLM engine: vLLM v1 `AsyncLLM` embedded in the worker process.

* Prompts go in as token ids, already rendered (`TokensInput`): ingress
  tokenized them with the model directory's own tokenizer, so the engine
  sees exactly what kvlane counted, hashed and routed on. A raw
  `TokensPrompt` would be rendered again, in vLLM's renderer thread pool:
  a thread hand-off and a GIL contest per request, for nothing.
* Outputs come back as deltas (`RequestOutputKind.DELTA`): each carries the
  new token ids and the new text; vLLM applies stop strings itself.
* Closing the iterator early closes vLLM's generator, which aborts the
  request inside the engine and frees its KV blocks.
* A request with `api` set is sampled and shaped as `vllm serve` would
  (vllm_api.py): its body becomes vLLM's own request, its sampling comes
  from that, and each choice's output is parsed (tool calls, reasoning)
  and carries its logprobs. Every choice of an `n` > 1 request yields its
  own outputs, with its index.
* A resumed request's structured output goes on where it left off: the
  engine core runs a logits processor (vllm_resumed_grammar.py) that
  advances vLLM's own grammar over the resumed tokens, in place of vLLM's
  structured output for that request.
* Stats arrive through vLLM's stat-logger interface (called in this
  process's event loop for every engine-core step); KV events through a
  ZMQ SUB socket that this process binds and vLLM's publisher connects to,
  so no event is published before anyone listens.
* Prefill/decode disaggregation rides on vLLM's NixlConnector: a prefill
  engine runs the prompt with `max_tokens=1` and holds its KV, whose
  `kv_transfer_params` become a `KvRef`; a decode engine gets that dict back
  and pulls the KV before decoding (see vllm_nixl.py, vllm_kv_ref.py).
* An aggregated engine with kv_share does both halves for a prefix: its
  `prefill` holds a cached prefix's KV as a prefill engine holds a prompt's,
  and its `generate` pulls a referenced prefix from another such engine and
  computes the rest of the prompt (vLLM's partial pull, vllm_kv_ref.py).

Named `vllm_engine` so that it never shadows the `vllm` package.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import tempfile
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping

import msgspec
import structlog
import zmq
from vllm import SamplingParams as VllmSamplingParams
from vllm import envs as vllm_envs
from vllm.config import KVTransferConfig
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMClientError
from vllm.inputs import TokensInput, tokens_input
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import PrometheusStatLogger

from contracts.messages import EngineStats, FinishReason, KvRef, SamplingParams
from services.worker.engines.base import (
    EngineConfigError,
    EngineOutput,
    EngineRequest,
    KvCacheDelta,
    KvPullFailed,
    LocalAdapter,
    RequestRejected,
    check_fits,
    net_kv_delta,
)
from services.worker.engines.kv_rehash import KvEventRehasher
from services.worker.engines.vllm_api import ApiRun, ApiSurface, check_parser_settings, vllm_rejection
from services.worker.engines.vllm_kv_ref import (
    REMOTE_CACHED_TOKENS,
    kv_ref_from_params,
    params_from_kv_ref,
    prefix_pull_params,
    producer_request_params,
)
from services.worker.engines.vllm_preflight import ResolvedEngine
from services.worker.engines.vllm_resumed_grammar import RESUMED_GRAMMAR_PROCESSOR
from shared.adapter_store import AdapterError
from shared.config import LoraSettings, VllmSettings

log = structlog.get_logger("kvlane.worker.vllm")

KV_EVENTS_TOPIC = "kv-events"
# vLLM starts a producer's lease when the prefill finishes, a little before
# this process sees the output: a reference expires this much earlier than
# the blocks, so that nobody pulls blocks already freed and reused.
KV_EXPIRY_MARGIN_S = 1.0


class PromptSources(msgspec.Struct, frozen=True):
    """Prompt tokens since the engine started, by where their KV came from (vLLM's prompt token stats)."""

    computed: int = 0
    local_hits: int = 0  # this engine's prefix cache
    external_hits: int = 0  # loaded by the KV connector: pulled from another engine


class StepCounters:
    """What the heartbeat reports, folded from vLLM's per-step stats (pure)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.prefix_queries = self.prefix_hits = self.preemptions = 0
        self.kv_pulls = self.kv_pull_bytes = 0
        self.kv_pull_seconds = 0.0
        self.prompt_sources = PromptSources()
        self.adapters_running: list[str] = []
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
            if scheduler_stats.kv_connector_stats:
                self.on_kv_transfers(scheduler_stats.kv_connector_stats)
            # The adapters of the requests scheduled now: the batch slots they hold.
            self.adapters_running = list(scheduler_stats.running_lora_adapters)
        if iteration_stats is not None:
            prompt = iteration_stats.prompt_token_stats
            self._prefill_tokens += prompt.computed
            local, external = getattr(prompt, "local_cache_hit", 0), getattr(prompt, "external_kv_transfer", 0)
            if prompt.computed or local or external:
                sources = self.prompt_sources
                self.prompt_sources = PromptSources(sources.computed + prompt.computed, sources.local_hits + local,
                                                    sources.external_hits + external)
            self._decode_tokens += iteration_stats.num_generation_tokens
            self.preemptions += iteration_stats.num_preempted_reqs

    def on_kv_transfers(self, transfers: Mapping) -> None:
        """NixlConnector's transfer stats since its previous report: one entry per finished pull."""
        moved = transfers.get("bytes_transferred") or ()
        self.kv_pulls += len(moved)
        self.kv_pull_bytes += int(sum(moved))
        self.kv_pull_seconds += float(sum(transfers.get("transfer_duration") or ()))

    def take_rates(self) -> tuple[float, float]:
        """Prefill and decode tokens per second since the previous call."""
        now = self._clock()
        elapsed = max(now - self._rate_since, 1e-9)
        rates = self._prefill_tokens / elapsed, self._decode_tokens / elapsed
        self._prefill_tokens = self._decode_tokens = 0
        self._rate_since = now
        return rates


def _stat_logger_factory(counters: StepCounters):
    """A vLLM stat logger feeding `counters`, in place of vLLM's Prometheus logger.

    vLLM adds its own Prometheus logger unless one is given. Its histograms
    are observed for every running request at every step, and nothing reads
    them here: the worker serves its own registry only (metrics.py), and
    ingress exports the fleet's numbers from the heartbeats. Being a
    `PrometheusStatLogger` (without its metrics) keeps that cost out.
    """

    # Relies on how vLLM's StatLoggerManager treats its loggers: tests/vllm/test_vllm_internals.py pins it.
    class CountersLogger(PrometheusStatLogger):
        def __init__(self, vllm_config, engine_indexes: list[int] | None = None) -> None:
            pass  # no metrics of vLLM's are registered

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            counters.on_step(scheduler_stats, iteration_stats)

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
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


def resumed_grammar_loadable(args: Mapping) -> bool:
    """Whether vLLM will run the resumed-grammar processor under these engine args: it implements the V1 model
    runner's logits-processor interface, which runs where Triton is missing (the CPU platform) or the V2 runner is
    turned off (VLLM_USE_V2_MODEL_RUNNER=0); vLLM refuses custom logits processors with speculative decoding.
    Where it is not loaded, resuming a structured output is refused (vllm_api.runs_resumed_grammar)."""
    from vllm.triton_utils import HAS_TRITON

    # Speculative decoding and sampling-mask replay refuse custom processors; watermarking and HiSparse attention
    # force the V2 runner.
    attention = args.get("attention_config")
    if (args.get("speculative_config") or args.get("return_sampling_mask") or args.get("watermark_config")
            or (isinstance(attention, Mapping) and attention.get("hisparse_config"))):
        return False
    return vllm_envs.VLLM_USE_V2_MODEL_RUNNER is False or (vllm_envs.VLLM_USE_V2_MODEL_RUNNER is None and not HAS_TRITON)


def _finish_reason(vllm_reason: str | None) -> FinishReason | None:
    if vllm_reason is None:
        return None
    if vllm_reason in ("stop", "length", "abort"):
        return vllm_reason  # type: ignore[return-value]
    raise RuntimeError(f"vLLM finished the request with {vllm_reason!r}")


class Submission(msgspec.Struct):
    """What vLLM is given for one request."""

    prompt: TokensInput
    sampling: VllmSamplingParams
    # The KV reference to pull first (a decode node's request), or None.
    kv_ref: KvRef | None
    # The API request's sampling and output shaping (None: plain text, as sampled).
    api_run: ApiRun | None

    def engine_kwargs(self) -> dict:
        return self.api_run.engine_kwargs if self.api_run is not None else {}


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


def _adapter_keys_only(extra_keys: list | None, lora_name: str | None) -> bool:
    """Whether each block's extra keys name nothing but its LoRA adapter (no image, salt or prompt embedding)."""
    return all(not keys or (lora_name is not None and tuple(keys) == (lora_name,)) for keys in extra_keys or ())


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
                        # Multimodal or salted blocks hash differently from plain tokens (a LoRA adapter's
                        # chain from its root); the LoRA name is among vLLM's extra keys too.
                        if _adapter_keys_only(event.extra_keys, event.lora_name):
                            self._rehasher.stored(event.block_hashes, event.parent_block_hash, event.token_ids,
                                                  event.block_size, event.lora_name)
                    case BlockRemoved():
                        self._rehasher.removed(event.block_hashes)
                    case AllBlocksCleared():
                        self._rehasher.all_cleared()

    def close(self) -> None:
        self._socket.close(linger=0)
        shutil.rmtree(self._directory, ignore_errors=True)


class VllmEngine:
    def __init__(
        self,
        settings: VllmSettings,
        resolved: ResolvedEngine,
        served_model_name: str,
        role: str = "aggregated",
        kv_hold_s: float = 30.0,
        kv_transfer: Mapping | None = None,
        env: Mapping[str, str] | None = None,
        lora: LoraSettings | None = None,
        kv_share: bool = False,
    ) -> None:
        self._settings = settings
        # LoRA adapters: off unless max_loras is set (vLLM's enable_lora costs memory and a little time per step).
        self._lora = lora if lora is not None and lora.max_loras else None
        # The adapters given to the engine, least recently used first: what vLLM's host cache holds, as it evicts.
        self._loras: OrderedDict[str, LoRARequest] = OrderedDict()
        self._lora_loading: dict[str, asyncio.Future[LoRARequest]] = {}
        self._lora_ids = itertools.count(1)
        self._adapter_loads = 0
        self._adapter_load_seconds = 0.0
        self._resolved = resolved
        self._served_model_name = served_model_name
        self._role = role
        # An aggregated engine that holds its prefixes for other engines and pulls theirs (`WorkerSettings.shares_kv`).
        self._kv_share = kv_share
        self._kv_hold_s = kv_hold_s
        # vLLM's kv_transfer_config (vllm_nixl.py); None for an aggregated worker without kv_share.
        self._kv_transfer = dict(kv_transfer) if kv_transfer else None
        # Variables the engine core must inherit (NIXL side channel, CPU reservation).
        self._env = dict(env or {})
        self._counters = StepCounters()
        self._rehasher = KvEventRehasher(resolved.block_size)
        self._kv_events: KvEventSubscriber | None = None
        self._gpu = GpuProbe()
        self._engine: AsyncLLM | None = None
        # Built once the engine started (it needs its tokenizer and model config).
        self._api: ApiSurface | None = None
        self._kv_blocks_total = 0
        # Before anything starts: a worker with impossible parser options stops at once.
        check_parser_settings(settings)
        # Requests submitted that have had no output yet: their prompt is still queued or prefilling
        # (or, on a decode node, its KV still being pulled). vLLM's scheduler counts only the waiting ones.
        self._awaiting_first_output: set[str] = set()

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
        if self._lora is not None:
            args.update(enable_lora=True, max_loras=self._lora.max_loras, max_lora_rank=self._lora.max_lora_rank,
                        max_cpu_loras=max(self._lora.max_cpu_loras, self._lora.max_loras))
        if settings.reasoning_parser:
            # The engine core's too, as `vllm serve --reasoning-parser` sets it: structured outputs start
            # constraining only once the reasoning ended.
            args["reasoning_parser"] = settings.reasoning_parser
        if self._kv_transfer is not None:
            args["kv_transfer_config"] = self._kv_transfer
        args.update(settings.extra_engine_args)
        if resumed_grammar_loadable(args):
            # Resumes a structured output partway through its grammar (vllm_resumed_grammar.py); it costs nothing
            # for any other request. By its qualified name: the engine core imports it itself.
            args["logits_processors"] = [*(args.get("logits_processors") or ()), RESUMED_GRAMMAR_PROCESSOR]
        if isinstance(args.get("kv_transfer_config"), dict):
            args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
        return AsyncEngineArgs(**args)

    async def start(self) -> None:
        # vLLM's CPU platform lets this legacy variable override
        # kv_cache_memory_bytes; preflight already folded it into the size.
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        # One engine per worker process: its engine core reads these at start.
        os.environ.update(self._env)
        self._kv_events = KvEventSubscriber(self._rehasher)
        # Read afresh: an engine started before in this process may have cached other values.
        vllm_envs.disable_envs_cache()
        try:
            args = self.engine_args(self._kv_events.endpoint)
            self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self._counters)])
        except Exception as exc:
            # vLLM has logged the details; the worker stops with one line naming the cause.
            raise EngineConfigError(f"vLLM engine failed to start: {_root_cause(exc)}") from exc
        # What vLLM's engine-core processes do once started: without the cache, every
        # `vllm.envs` attribute is an environment lookup, and vLLM's output processing
        # reads some for every request at every step.
        vllm_envs.enable_envs_cache()
        self._api = ApiSurface.of_engine(self._settings, self._engine)
        self._kv_blocks_total = self._engine.vllm_config.cache_config.num_gpu_blocks or 0
        log.info("vllm_engine_started", model=self._served_model_name, role=self._role, kv_share=self._kv_share,
                 kv_blocks=self._kv_blocks_total, block_size=self._resolved.block_size,
                 max_model_len=self._resolved.max_model_len, nixl_side_channel=self._side_channel())

    def _side_channel(self) -> str | None:
        host, port = self._env.get("VLLM_NIXL_SIDE_CHANNEL_HOST"), self._env.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
        return f"{host}:{port}" if host and port else None

    async def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        if self._kv_events is not None:
            self._kv_events.close()
            self._kv_events = None

    def check(self, request: EngineRequest) -> None:
        check_fits(request, self._resolved.max_model_len, self._resolved.shape.vocab_size)

    @property
    def errored(self) -> bool:
        # AsyncLLM's own flag: its engine core died (EngineDeadError in every request) or its output loop ended.
        return self._engine is not None and self._engine.errored

    def _running(self) -> AsyncLLM:
        if self._engine is None:
            raise RuntimeError("the vLLM engine is not running")
        return self._engine

    async def prefill(self, request: EngineRequest, source_worker_id: str, hold_s: float) -> KvRef:
        self.check(request)
        engine = self._running()
        if self._role != "prefill" and not self._kv_share:
            raise RuntimeError(f"prefill() needs worker.role 'prefill' or worker.kv_share, not role {self._role!r} "
                               "without it: only a KV producer holds KV")
        prompt = list(request.prompt_token_ids) + list(request.resume_token_ids)
        # One greedy token: the prompt's KV is what counts; the token is
        # dropped, and the decode node samples the first one itself.
        params = VllmSamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                    output_kind=RequestOutputKind.FINAL_ONLY,
                                    extra_args={"kv_transfer_params": producer_request_params()})
        final = None
        outputs = engine.generate(tokens_input(prompt), params, request.request_id)
        # Its one output comes one step after its prompt is prefilled.
        self._awaiting_first_output.add(request.request_id)
        try:
            async with contextlib.aclosing(outputs):  # cancelled: aborts, and vLLM frees the blocks
                try:
                    async for output in outputs:
                        final = output
                except (VLLMClientError, ValueError) as exc:
                    raise vllm_rejection(exc) from exc
        finally:
            self._awaiting_first_output.discard(request.request_id)
        reason = final.outputs[0].finish_reason if final is not None and final.outputs else None
        if final is None or reason not in ("stop", "length") or not final.kv_transfer_params:
            raise RuntimeError(f"vLLM prefill of {request.request_id} ended with {reason!r} and no KV to hand over")
        transfer = dict(final.kv_transfer_params)
        transfer[REMOTE_CACHED_TOKENS] = final.num_cached_tokens or 0
        # vLLM's lease is fixed when the engine starts: a longer hold_s cannot extend it.
        hold = min(hold_s, self._kv_hold_s) - KV_EXPIRY_MARGIN_S
        return kv_ref_from_params(
            transfer,
            source_worker_id=source_worker_id,
            prompt_tokens=len(prompt),
            kv_bytes_per_token=self._resolved.shape.kv_bytes_per_token(self._settings.dtype),
            block_size=self._resolved.block_size,
            hold_s=max(hold, 0.0),
        )

    def release_kv(self, request_id: str) -> None:
        # Nothing to do, and nothing vLLM would let us do: its NixlConnector
        # frees a producer's blocks itself once the consumer has read them
        # (the consumer notifies it), and otherwise when the lease
        # (kv_lease_duration = worker.kv_hold_timeout_s) runs out. AsyncLLM
        # has no call that frees a finished request's held blocks early.
        pass

    def _submission(self, request: EngineRequest) -> Submission:
        """What vLLM is given for `request`: its prompt, its sampling, the KV reference to pull, the API shaping."""
        self.check(request)
        # A reference is used only where there is a consumer to pull it; any
        # other engine simply prefills the prompt itself.
        kv_ref = request.kv_ref if self._role == "decode" or self._kv_share else None
        if kv_ref is not None and request.kv_held_until is not None and request.kv_held_until <= time.monotonic():
            # Its blocks may be freed and reused by now: a pull would read someone else's KV.
            raise KvPullFailed(f"KV reference for {request.request_id} expired before the pull")
        # A resumed request replays what it already produced as prompt and
        # generates the rest (greedy decoding continues exactly).
        resumed = list(request.resume_token_ids)
        prompt = list(request.prompt_token_ids) + resumed
        if kv_ref is not None and self._kv_share and len(prompt) < kv_ref.num_tokens:
            # vLLM would pair the reference's last blocks with the prompt's first ones.
            raise KvPullFailed(f"the prompt of {request.request_id} ({len(prompt)} tokens) is shorter than the "
                               f"{kv_ref.num_tokens}-token prefix it would pull")
        api_run = None
        if request.api is not None:
            if self._api is None:
                raise RuntimeError("the vLLM engine is not running")
            api_run = self._api.prepare(request)
            sampling = api_run.sampling
        else:
            sampling = to_vllm_sampling(
                msgspec.structs.replace(request.sampling, max_tokens=request.sampling.max_tokens - len(resumed))
            )
        if kv_ref is not None:
            # A decode node pulls the whole prompt; a kv_share engine the prefix, then computes the rest.
            transfer = prefix_pull_params(kv_ref) if self._kv_share else params_from_kv_ref(kv_ref)
            sampling.extra_args = {**(sampling.extra_args or {}), "kv_transfer_params": transfer}
        return Submission(tokens_input(prompt), sampling, kv_ref, api_run)

    @staticmethod
    def _engine_outputs(request: EngineRequest, submission: Submission, output: RequestOutput,
                        produced: bool) -> list[EngineOutput]:
        """One output per choice that `output` carries (an `n` > 1 request's choices come in any order)."""
        kv_ref = submission.kv_ref
        if kv_ref is not None and not produced and any(c.finish_reason == "error" for c in output.outputs):
            # kv_load_failure_policy "fail": vLLM ends the request
            # with an error and no token when the pull fails.
            log.warning("kv_pull_failed", request_id=request.request_id, source=kv_ref.source_worker_id,
                        engine_id=kv_ref.engine_id, side_channel=f"{kv_ref.host}:{kv_ref.port}")
            raise KvPullFailed(f"pulling the KV of {request.request_id} from {kv_ref.source_worker_id} failed")
        cached_tokens = output.num_cached_tokens or 0
        if submission.api_run is None:
            completion = output.outputs[0]
            return [EngineOutput(
                token_ids=list(completion.token_ids),
                text=completion.text,
                finish_reason=_finish_reason(completion.finish_reason) if output.finished else None,
                cached_tokens=cached_tokens,
            )]
        # Each choice of an `n` > 1 request ends on its own: its finish reason, not the request's, says so.
        return [submission.api_run.output(completion, cached_tokens, _finish_reason(completion.finish_reason), output.prompt_logprobs)
                for completion in output.outputs]

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        submission = self._submission(request)
        engine = self._running()
        lora_request = await self._lora_request(request)
        outputs = engine.generate(submission.prompt, submission.sampling, request.request_id, lora_request=lora_request,
                                  **submission.engine_kwargs())
        produced = False
        awaiting = self._awaiting_first_output
        awaiting.add(request.request_id)
        # aclosing: an early close (client gone, deadline) closes vLLM's
        # generator, whose GeneratorExit handler aborts the request.
        try:
            async with contextlib.aclosing(outputs):
                try:
                    async for output in outputs:
                        if not produced:
                            awaiting.discard(request.request_id)
                        engine_outputs = self._engine_outputs(request, submission, output, produced)
                        produced = True
                        for engine_output in engine_outputs:
                            yield engine_output
                except RequestRejected:
                    raise
                except (VLLMClientError, ValueError) as exc:
                    raise vllm_rejection(exc) from exc
        finally:
            awaiting.discard(request.request_id)

    async def stream(self, request: EngineRequest, on_output: Callable[[EngineOutput], None]) -> None:
        """`generate`, with every output handed to `on_output` from vLLM's output handler itself.

        `AsyncLLM.add_request` returns the request's output collector, into
        which vLLM's output handler puts each `RequestOutput` as it
        processes an engine step; `generate` then wakes a task to take it
        out. Here the collector's `put` delivers the output on the spot, so
        that no task per request wakes at each step.
        """
        submission = self._submission(request)
        engine = self._running()
        lora_request = await self._lora_request(request)
        try:
            collector = await engine.add_request(request.request_id, submission.prompt, submission.sampling,
                                                 lora_request=lora_request, **submission.engine_kwargs())
        except (VLLMClientError, ValueError) as exc:
            raise vllm_rejection(exc) from exc
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        produced = finished = False
        awaiting = self._awaiting_first_output
        awaiting.add(request.request_id)

        def deliver(output: RequestOutput | Exception) -> None:
            nonlocal produced, finished
            if ended.done():
                return  # e.g. the final output of the abort below
            if isinstance(output, Exception):  # the engine died: vLLM fails every request
                ended.set_exception(output)
                return
            finished = output.finished
            if not produced:
                awaiting.discard(request.request_id)
            try:
                engine_outputs = self._engine_outputs(request, submission, output, produced)
                produced = True
                for engine_output in engine_outputs:
                    on_output(engine_output)
            except Exception as exc:  # raised in the caller, never into vLLM's output handler
                ended.set_exception(exc)
                return
            if finished:
                ended.set_result(None)

        # vLLM internal (its output handler calls the collector's `put` at each step): tests/vllm/test_vllm_internals.py.
        collector.put = deliver  # type: ignore[method-assign]
        # Anything the output handler put before the collector was rewired.
        try:
            early = collector.get_nowait()
        except Exception as exc:
            early = exc
        if early is not None:
            deliver(early)
        try:
            await ended
        finally:
            awaiting.discard(request.request_id)
            collector.close()
            if not finished and not engine.errored:
                # Cancelled (client gone, deadline, hand-back) or failed here: abort it in
                # the engine, which frees its KV blocks, as `generate`'s generator does.
                await engine.abort(collector.request_id, internal=True)

    async def _lora_request(self, request: EngineRequest) -> LoRARequest | None:
        """The request's adapter as vLLM names it, given to the engine first (once per adapter's files), so that an
        adapter vLLM cannot load fails this request alone with `AdapterError`, never the engine's step."""
        adapter = request.adapter
        if adapter is None:
            return None
        if self._lora is None:
            raise RequestRejected("this worker serves no LoRA adapter (worker.lora.max_loras = 0)", param="model")
        known = self._loras.get(adapter.name)
        if known is not None and known.lora_path == adapter.path:
            self._loras.move_to_end(adapter.name)
            return known
        loading = self._lora_loading.get(adapter.path)
        if loading is None:
            loading = self._lora_loading[adapter.path] = asyncio.ensure_future(self._load_lora(adapter))
            loading.add_done_callback(lambda done: self._lora_loading.pop(adapter.path, None))
        return await asyncio.shield(loading)

    async def _load_lora(self, adapter: LocalAdapter) -> LoRARequest:
        lora_request = LoRARequest(adapter.name, next(self._lora_ids), adapter.path)
        started = time.monotonic()
        try:
            await self._running().add_lora(lora_request)
        except Exception as exc:
            if self.errored:
                raise
            # vLLM keeps the id of an adapter it failed to load, and would run it as the base model: never use it again.
            with contextlib.suppress(Exception):
                await self._running().remove_lora(lora_request.lora_int_id)
            raise AdapterError(f"the engine cannot load adapter {adapter.name}: {_root_cause(exc)}") from exc
        self._adapter_loads += 1
        self._adapter_load_seconds += time.monotonic() - started
        # Another revision of the adapter is replaced here; vLLM's cache lets its weights go in their turn (requests
        # still running with them keep them until they end).
        self._loras.pop(adapter.name, None)
        self._loras[adapter.name] = lora_request
        assert self._lora is not None
        while len(self._loras) > max(self._lora.max_cpu_loras, self._lora.max_loras):
            self._loras.popitem(last=False)  # vLLM's host cache dropped its least recently used one too
        log.info("adapter_loaded", adapter=adapter.name, seconds=round(time.monotonic() - started, 3))
        return lora_request

    def prompt_sources(self) -> PromptSources:
        """Prompt tokens since the engine started: computed here, hit in this engine's prefix cache, pulled."""
        return self._counters.prompt_sources

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
            prefilling=0 if idle else len(self._awaiting_first_output),
            kv_blocks_total=self._kv_blocks_total,
            kv_blocks_used=round(counters.kv_usage * self._kv_blocks_total),
            prefix_query_tokens=counters.prefix_queries,
            # vLLM's prefix cache stats count this engine's own cache only; what its connector loaded (a decode
            # node's hand-off, a prefix pull) is counted apart, in its prompt token stats.
            prefix_hit_tokens=counters.prefix_hits,
            prefix_external_hit_tokens=counters.prompt_sources.external_hits,
            preemptions=counters.preemptions,
            prefill_tokens_per_s=prefill_rate,
            decode_tokens_per_s=decode_rate,
            gpu_utilization=self._gpu.utilization(),
            kv_pulls=counters.kv_pulls,
            kv_pull_bytes=counters.kv_pull_bytes,
            kv_pull_seconds=counters.kv_pull_seconds,
            # Counted by the worker service, which sees every KvPullFailed
            # (this engine's and its own check with the source) and adds them.
            kv_pull_failures=0,
            # vLLM reports no count of the blocks a producer holds for
            # consumers (they are freed inside its connector): not known.
            kv_held_blocks=0,
            **self._adapter_stats([] if idle else counters.adapters_running),
        )

    def _adapter_stats(self, running: list[str]) -> dict:
        """Where the adapters are, as far as vLLM shows it: the running ones are in batch slots, and so (vLLM's
        slots drop the least recently used) are the most recently used of the others, up to `max_loras`."""
        if self._lora is None:
            return {}
        recent = [name for name in reversed(self._loras) if name not in running]
        in_slots = running + recent[: max(0, self._lora.max_loras - len(running))]
        return dict(adapters_active=in_slots, adapters_running=running,
                    adapters_cached=[name for name in self._loras if name not in in_slots], adapter_loads=self._adapter_loads,
                    adapter_load_s=self._adapter_load_seconds / self._adapter_loads if self._adapter_loads else 0.0)
