"""Internal wire messages (msgpack over NATS, JSON in Redis).

Each subject that carries several kinds of message uses a tagged union
(`type` field, or the first element of a `Compact` message's array), so a
receiver decodes with one typed decoder and dispatches with `match`. A
deadline crosses the wire as the time left (`timeout_s`, seconds when
sent), never as a moment: hosts' clocks disagree, so each receiver turns
it into a moment on its own clock as it arrives. The other
moments on the wire (heartbeats' `sent_at`, registrations' `started_at`) are
Unix epoch seconds, only ever compared with moments of the same sender.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from contracts.model_files import AdapterRef

RequestId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
WorkerId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
NonNegativeInt = Annotated[int, Meta(ge=0)]
# A moment as Unix epoch seconds, finite and at most 1e11 (the year 5138); a NaN or infinite one never decodes.
EpochSeconds = Annotated[float, Meta(ge=0.0, le=1e11)]
# Time left before a deadline, in seconds when the message was sent (0: already passed), finite and at most
# about 31 years. Its receiver turns it into a moment on its own clock; a NaN or infinite one never decodes.
RemainingSeconds = Annotated[float, Meta(ge=0.0, le=1e9)]
# A subject kvlane publishes to (an inbox, a stream): dot-separated tokens, no wildcards or spaces.
Subject = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$", max_length=256)]
# The same, or empty for none.
OptionalSubject = Annotated[str, Meta(pattern=r"^([A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*)?$", max_length=256)]
FinishReason = Literal["stop", "length", "abort"]
WorkerRole = Literal["aggregated", "prefill", "decode"]
EngineKind = Literal["sim", "vllm"]


class Compact(Struct, array_like=True, gc=False, omit_defaults=True):
    """The base of the messages sent on every request or engine step: a msgpack array in field order (the field
    names were most of their bytes), trailing fields at their default left off, and instances the garbage collector
    never tracks (fewer collections while frames pour in; safe because these hold only numbers, text, and lists and
    Structs of them: nothing that could lead back to them and close a cycle).

    Positional on the wire: a new field goes at the end of its Struct, with a default. A union mixes no array-like
    and map-like Structs (msgspec refuses it), so every member of a union with one `Compact` member is `Compact`:
    `ErrorReply` makes every reply and stream frame one.
    """


class ErrorReply(Compact, tag="error", tag_field="type"):
    """A failure answered instead of the expected reply or stream frame.

    `status` is the HTTP status ingress should answer with; `retry_after_s`
    becomes a Retry-After header when set.
    """

    code: str
    message: str
    status: int = 500
    retry_after_s: float | None = None
    # The request parameter at fault, when there is one (the OpenAI error's `param`).
    param: str | None = None


# --- routing ------------------------------------------------------------------


class RouteRequest(Compact, tag="route", tag_field="type"):
    request_id: RequestId
    model: str
    prompt_tokens: NonNegativeInt
    max_tokens: Annotated[int, Meta(ge=1)]
    timeout_s: RemainingSeconds
    block_hashes: list[int] = []
    priority: int = 0
    exclude_workers: list[WorkerId] = []
    # The prompt's first tokens, for the cache-manager's hot-prefix pre-warming.
    prefix_token_ids: list[int] = []
    # The tenant of the caller's API key (empty when the ingress does not require keys); balancers label spans with it.
    tenant: str = ""
    # The worker's request, for the balancer to send on as it decides (one hop fewer than the ingress sending it
    # once the decision is back): the balancer sends it where the chain is one node and the request is not
    # degraded, and the worker answers to its `accept_to`. None: the ingress hands the request over itself.
    hand_over: GenerateRequest | None = None
    # The LoRA adapter the request runs with ("": the base model, `model`): balancers cost its load on each node.
    adapter: str = ""
    # The tenant's weight in fair sharing (its API key's `weight`): a tenant of weight 2 is served twice the tokens
    # of one of weight 1 when both keep requests waiting.
    tenant_weight: Annotated[float, Meta(gt=0.0)] = 1.0


class RouteWithdrawn(Compact, tag="route_withdrawn", tag_field="type"):
    """Ingress no longer wants the route it asked for: its client left while the request was being
    routed or queued. Balancers drop it from the queue or free its slot, cache-managers its lease."""

    request_id: RequestId


class RouteDecision(Compact, tag="decision", tag_field="type"):
    """Where one request runs: `worker_id` generates its tokens.

    When `prefill_worker_id` is set the chain has two nodes: ingress sends a
    `PrefillRequest` to `prefill_inbox`, and that node hands the KV cache to
    `worker_id` (a decode node). Empty: `worker_id` runs the whole request.
    """

    request_id: RequestId
    worker_id: WorkerId
    inbox: str
    policy: str
    cached_blocks: NonNegativeInt = 0
    prefill_worker_id: str = ""
    prefill_inbox: str = ""
    # A prefix pull: the first node (`prefill_worker_id`) runs only the first `prefix_tokens` prompt tokens, which
    # it caches, and `worker_id` pulls their KV and computes the rest (`PrefillRequest.prefix_tokens`). 0: no pull.
    prefix_tokens: NonNegativeInt = 0
    # Seconds the request waited in the balancer's central queue for a free slot (0: placed at once).
    queued_s: Annotated[float, Meta(ge=0.0)] = 0.0
    # The tokens it may generate: the route request's max_tokens, or fewer when the
    # balancer degraded it under overload (0: as asked, from a balancer that does not say).
    max_tokens: NonNegativeInt = 0
    # The balancer sent the route request's `hand_over` on to `inbox`: the worker answers to its `accept_to`.
    handed_over: bool = False
    # When the process of `worker_id` it chose started (its registration's `started_at`; 0: not said).
    started_at: EpochSeconds = 0.0


RouteReply = RouteDecision | ErrorReply


# --- generation -----------------------------------------------------------------


class SamplingParams(Compact, forbid_unknown_fields=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    seed: int | None = None
    stop: list[str] = []
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    ignore_eos: bool = False
    # Choices sampled in parallel from one prompt (`n`), on one node.
    n: Annotated[int, Meta(ge=1)] = 1


class ApiRequest(Compact):
    """The OpenAI request a run answers, for what the engine reads of it beyond tokens and `SamplingParams`.

    `body` is the request's JSON without its prompt (`messages` or `prompt`, which ride as token ids): an engine
    builds its sampling (structured outputs, logprobs, logit bias, its own extras) and shapes its output
    (tool calls, reasoning) from it, as the engine's own API server would. `stream`: the client reads deltas
    (parsed as they come) rather than one whole answer (parsed once at the end).
    """

    kind: Literal["chat", "completion"]
    body: bytes
    stream: bool = False


class KvRef(Struct, frozen=True):
    """Where a prompt's KV cache waits to be pulled: a reference, never the bytes.

    The source node holds the blocks until the puller releases them or
    `hold_s` has passed. For vLLM the fields are its NixlConnector's
    `kv_transfer_params`; `engine_extras` carries the keys of that dict
    kvlane does not name, passed back to the engine untouched.
    """

    source_worker_id: WorkerId
    engine_id: str
    request_id: str
    num_tokens: NonNegativeInt  # prompt tokens whose KV the source holds
    # How much longer the source holds the blocks, in seconds when the reference was sent.
    hold_s: RemainingSeconds
    block_ids: list[list[int]] = []
    host: str = ""
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    kv_bytes: NonNegativeInt = 0
    # Prompt tokens the source found in its own prefix cache: what the
    # client's usage reports as cached (pulled tokens were computed, not hit).
    cached_tokens: NonNegativeInt = 0
    engine_extras: dict[str, str | int | float | bool | None] = {}


class RequestToRun(Compact):
    """What every node that runs part of a request gets: the prompt, the sampling, where to stream."""

    request_id: RequestId
    model: str
    prompt_token_ids: Annotated[list[int], Meta(min_length=1)]
    sampling: SamplingParams
    stream_to: Subject
    # Time left to finish the request: a node that forwards it sends what is left then.
    timeout_s: RemainingSeconds
    # Tokens a previous run already streamed to the client (migration after a
    # worker died, or resumption after preemption): generation continues
    # after them, and they count toward `sampling.max_tokens` and usage.
    resume_token_ids: list[int] = []
    # The API request, for an engine to sample and shape output as the API asks (None: plain text, as sampled).
    api: ApiRequest | None = None
    # The LoRA adapter to run with, fetched from the bus on its first use here (None: the base model).
    adapter: AdapterRef | None = None


class GenerateRequest(RequestToRun, tag="generate", tag_field="type"):
    """Run one request and stream its frames to `stream_to`.

    The worker answers the NATS request with `GenerateAccepted` (or an
    `ErrorReply`) at once, then publishes `TokenChunk` frames and ends the
    stream with `StreamEnd` or `ErrorReply`.
    """

    # Set on a decode node's request: pull the prompt's KV from here first.
    kv_ref: KvRef | None = None
    # Where the worker answers (accepted or refused), when not to the message's reply subject: the
    # ingress waits there for a request that its balancer sent on (`RouteRequest.hand_over`).
    accept_to: OptionalSubject = ""


class PrefillRequest(RequestToRun, tag="prefill", tag_field="type", kw_only=True):
    """Run the prompt on a prefill node, then hand it to the decode node.

    The prefill node answers with `GenerateAccepted`, runs the prompt, and
    sends the decode node a `GenerateRequest` carrying a `KvRef` and the
    same `stream_to`; it publishes a `Handoff` frame there once the decode
    node accepted (or an `ErrorReply` if that failed). Tokens flow from the
    decode node straight to `stream_to`.
    """

    decode_worker_id: WorkerId
    decode_inbox: Subject
    # A prefix pull: run only the first `prefix_tokens` prompt tokens, which this node caches, and hand the
    # request over with their KV; the decode node pulls that prefix and computes the rest. 0: the whole prompt.
    prefix_tokens: NonNegativeInt = 0


class AbortRequest(Compact, tag="abort", tag_field="type"):
    request_id: RequestId
    reason: str = "client_disconnected"
    # Only the run that streams there, one attempt of the request (empty: whichever runs under its id).
    stream_to: OptionalSubject = ""


WorkerRequest = GenerateRequest | PrefillRequest | AbortRequest


class GenerateAccepted(Compact, tag="accepted", tag_field="type"):
    request_id: RequestId
    worker_id: WorkerId
    # When the accepting process started (its registration's `started_at`; 0: not said). A node that later
    # heartbeats under the same id with another start restarted, and the request went with the old process.
    started_at: EpochSeconds = 0.0


WorkerReply = GenerateAccepted | ErrorReply


class Usage(Compact):
    prompt_tokens: NonNegativeInt
    completion_tokens: NonNegativeInt
    cached_tokens: NonNegativeInt = 0


class Timings(Compact):
    """Worker-side timings, seconds since the worker accepted the request."""

    first_token_s: float | None = None
    finished_s: float = 0.0


class TopLogprob(Compact):
    token: str
    logprob: float
    bytes: list[int] | None = None
    token_id: int = 0


class TokenLogprob(Compact):
    """One generated token's log probability, and the most likely tokens at its position (as the engine ranks
    them, the sampled one included where the engine puts it). `logprob` is None when the engine gave none."""

    token: str
    logprob: float | None = None
    bytes: list[int] | None = None
    top: list[TopLogprob] = []
    token_id: int = 0


class ToolCallDelta(Compact):
    """A piece of a tool call being generated: its name when it starts, then pieces of its JSON arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


class OutputDelta(Compact):
    """What new output means, once the model's reasoning and tool-call markers are parsed out of it."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] = []


class ParsedToolCall(Compact):
    name: str
    arguments: str
    id: str | None = None


class ParsedOutput(Compact):
    """A finished choice's whole output, parsed once (what a non-streamed answer says)."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ParsedToolCall] = []
    reasoning_tokens: NonNegativeInt = 0


class TokenChunk(Compact, tag="chunk", tag_field="type"):
    request_id: RequestId
    seq: NonNegativeInt
    token_ids: list[int]
    text: str
    # The choice these tokens belong to (`n` > 1).
    index: NonNegativeInt = 0
    # One per token of `token_ids`, when the request asked for logprobs.
    logprobs: list[TokenLogprob] = []
    # `text` parsed (reasoning, tool calls), when the request's output is parsed and streamed.
    delta: OutputDelta | None = None
    # Set on a choice's last chunk: how it ended, what stopped it (a stop string or token id, as the
    # engine says), and, when the answer is not streamed, its whole output parsed.
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    parsed: ParsedOutput | None = None
    # On a choice's first chunk, when a completion echoes its prompt with logprobs: one per prompt token.
    prompt_logprobs: list[TokenLogprob] = []


class StreamEnd(Compact, tag="end", tag_field="type"):
    request_id: RequestId
    seq: NonNegativeInt
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    worker_id: WorkerId


class Handoff(Compact, tag="handoff", tag_field="type"):
    """The prefill node passed the request to `decode_worker_id` (not a numbered frame)."""

    request_id: RequestId
    prefill_worker_id: WorkerId
    decode_worker_id: WorkerId
    kv_tokens: NonNegativeInt


StreamFrame = TokenChunk | StreamEnd | Handoff | ErrorReply


class AddressedFrame(Struct, array_like=True, gc=False):
    """One frame of a batch, with the stream it belongs to (the last token of its `stream_to`)."""

    stream: str
    frame: StreamFrame


class StreamBatch(Compact, tag="batch", tag_field="type"):
    """The frames one worker produced in one engine step for the streams of one receiver.

    One message per step and receiver, not one per token and request: at
    32 streams that is 32 times fewer messages to encode, route and decode.
    Frames of one stream keep their order within and across batches.
    """

    frames: list[AddressedFrame]


# What a receiver's stream subscription carries: single frames (their stream
# is the subject's last token) or batches.
StreamMessage = StreamFrame | StreamBatch


# --- KV hand-off between a prefill and a decode node (`subjects.worker_kv`) ---------


class KvPull(Struct, tag="kv_pull", tag_field="type"):
    """A decode node asks the source to keep `request_id`'s blocks for its transfer."""

    request_id: RequestId
    puller_id: WorkerId


class KvPullGranted(Compact, tag="kv_granted", tag_field="type"):
    request_id: RequestId
    num_tokens: NonNegativeInt
    kv_bytes: NonNegativeInt


KvPullReply = KvPullGranted | ErrorReply


class KvRelease(Struct, tag="kv_release", tag_field="type"):
    """The puller has the KV (or gave up): the source may free the blocks."""

    request_id: RequestId


KvMessage = KvPull | KvRelease


class RequestFinished(Struct, tag="finished", tag_field="type"):
    """Published once per request the worker ran, however it ended (not for an attempt that a later attempt of
    the same request took the place of on that worker: the request went on there).

    A map, not `Compact`: the load-test harness reads it by field name (`loadtest/bench/events.py`), so that a
    field added later does not break a run.
    """

    request_id: RequestId
    worker_id: WorkerId
    finish_reason: FinishReason | Literal["error"]
    usage: Usage
    duration_s: float


# --- cluster state ----------------------------------------------------------------


NonNegativeSeconds = Annotated[float, Meta(ge=0.0)]


class StepTime(Struct, frozen=True):
    """A node's forward-pass time, in seconds: `a + b*prefill_tokens + c*decode_seqs + d*kv_tokens` per step,
    plus `per_request` once per request the engine takes in."""

    a: NonNegativeSeconds
    b: NonNegativeSeconds
    c: NonNegativeSeconds
    d: NonNegativeSeconds = 0.0
    per_request: NonNegativeSeconds = 0.0


class KvTransfer(Struct, frozen=True):
    """How this node's KV moves to or from another node: the model's KV bytes per token, over this node's link
    (a transfer of n bytes takes `link_latency_s + n / link_bytes_per_s`)."""

    bytes_per_token: Annotated[int, Meta(ge=1)]
    link_bytes_per_s: Annotated[float, Meta(gt=0.0)]
    link_latency_s: NonNegativeSeconds = 0.0


# Fields at their default stay off the wire (a reader fills them in): most of a heartbeat is zeros.
class WorkerRegistration(Struct, frozen=True, omit_defaults=True):
    worker_id: WorkerId
    role: WorkerRole
    model: str
    engine: EngineKind
    inbox: Subject
    block_size: Annotated[int, Meta(ge=1)]
    max_model_len: Annotated[int, Meta(ge=1)]
    tokenizer: str
    started_at: EpochSeconds
    host: str = ""
    # Most sequences the engine batches at once; 0 = not reported.
    max_num_seqs: Annotated[int, Meta(ge=0)] = 0
    # What a step costs on this node, when the worker knows (a sim profile,
    # or one `kvlane calibrate` fitted); balancers cost requests with it.
    step_time: StepTime | None = None
    # What handing a prompt's KV to or from this node costs, when the worker knows
    # (a sim worker); balancers add it to a two-node chain's cost.
    kv_transfer: KvTransfer | None = None
    # The tokenizer's files on the bus: an object of the model-files object store
    # (shared/model_store.py), for an ingress without the model directory; "": none published.
    tokenizer_files: str = ""
    # How the engine parses output, as `vllm serve`'s --tool-call-parser and --reasoning-parser name them
    # ("": none): a request for tools with tool_choice "auto" needs a tool-call parser.
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    # LoRA adapters the engine runs at once (as vLLM's --max-loras) and keeps loaded in host memory
    # (--max-cpu-loras); 0: it serves no adapter.
    max_loras: NonNegativeInt = 0
    max_cpu_loras: NonNegativeInt = 0
    # An aggregated node that also exposes its cached prefixes' KV to other nodes and pulls theirs (vLLM's
    # `kv_both`): a balancer may run a request here on a prefix pulled from a busy node that caches it.
    kv_share: bool = False


class EngineStats(Struct, omit_defaults=True):
    running: NonNegativeInt = 0
    waiting: NonNegativeInt = 0
    kv_blocks_total: NonNegativeInt = 0
    kv_blocks_used: NonNegativeInt = 0
    prefix_query_tokens: NonNegativeInt = 0
    prefix_hit_tokens: NonNegativeInt = 0
    preemptions: NonNegativeInt = 0
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    # None means "not known" (no GPU, or no reading): never report 0 for that.
    gpu_utilization: float | None = None
    # KV hand-off since the worker started: pulls done here, their bytes,
    # pulls that failed, and blocks held here for a decode node to pull.
    kv_pulls: NonNegativeInt = 0
    kv_pull_bytes: NonNegativeInt = 0
    kv_pull_failures: NonNegativeInt = 0
    kv_held_blocks: NonNegativeInt = 0
    # Seconds the pulls done here spent moving KV, summed since the worker started.
    kv_pull_seconds: Annotated[float, Meta(ge=0.0)] = 0.0
    # Prompt tokens whose KV was pulled from another node rather than computed here or found in this node's own
    # cache (external hits: a decode node's hand-off, a prefix pull), since the worker started.
    prefix_external_hit_tokens: NonNegativeInt = 0
    # Requests here whose prompt is not fully prefilled yet, waiting ones included: 0 says every prompt
    # the node had taken in by then is prefilled, which `waiting` alone cannot (a running request may
    # still be prefilling a long prompt in chunks). None: not reported (a worker from before this field).
    prefilling: NonNegativeInt | None = None
    # LoRA adapters: those in the engine's batch slots now (at most `max_loras`), those of them that running
    # requests hold (slots the engine cannot give up), those loaded in host memory besides; the loads into a slot
    # since the worker started, and the mean seconds a load of one not in host memory took (0: none yet).
    adapters_active: list[str] = []
    adapters_running: list[str] = []
    adapters_cached: list[str] = []
    adapter_loads: NonNegativeInt = 0
    adapter_load_s: Annotated[float, Meta(ge=0.0)] = 0.0


class Heartbeat(Compact, tag="heartbeat", tag_field="type"):
    registration: WorkerRegistration
    stats: EngineStats
    sent_at: EpochSeconds
    seq: NonNegativeInt
    draining: bool = False
    # A digest of `registration` (0: not given); the `LoadReport`s sent after this heartbeat name it.
    registration_digest: NonNegativeInt = 0

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id


class PackedStats(EngineStats, array_like=True):
    """`EngineStats` as a plain array, for load reports (every node sends one a second): the field
    names were most of their bytes. Positional, so a new `EngineStats` field goes at its end."""


class LoadReport(Compact, tag="load", tag_field="type"):
    """A heartbeat without the registration, which rarely changes: what a worker sends between full heartbeats.

    It applies to the registration whose digest is `registration_digest`. A receiver that holds no
    registration with that digest (it started late, or missed a change) ignores it until it has one:
    from the next full `Heartbeat` (sent on every change and every `cluster.full_heartbeat_every`th
    beat) or from the node's Redis key, which always holds the full heartbeat.
    """

    worker_id: WorkerId
    stats: PackedStats
    sent_at: EpochSeconds
    seq: NonNegativeInt
    registration_digest: NonNegativeInt
    draining: bool = False


# What the heartbeat subjects carry.
HeartbeatMessage = Heartbeat | LoadReport


class KvEvents(Compact, tag="kv_events", tag_field="type"):
    """What entered and left one worker's prefix cache since its previous batch.

    Hashes are kvlane's chained block hashes (`shared.kv.block_hash`), never an
    engine's own. A batch holds each hash's net change only, so the order of
    `stored` and `removed` does not matter. `seq` rises by one per batch: a
    subscriber that sees a gap knows its view of this worker is incomplete.
    """

    worker_id: WorkerId
    seq: NonNegativeInt
    block_size: Annotated[int, Meta(ge=1)]
    stored: list[int] = []
    removed: list[int] = []
    # The worker's whole cache was dropped before `stored` was applied.
    cleared: bool = False


class WorkerLeft(Struct, tag="worker_left", tag_field="type"):
    worker_id: WorkerId
    reason: str

