"""Configuration: one TOML file plus environment overrides, decoded strictly.

Every section forbids unknown keys, so a misspelt setting fails at start-up
with the offending path named, instead of being silently ignored.

Environment overrides use `KVLANE__SECTION__KEY=value` (double underscores
separate levels, names are case-insensitive); a value that starts with `"`,
`[` or `{` is read as JSON, anything else as text that numeric and boolean
fields convert. `KVLANE_CONFIG` names the file.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from shared.balancer_settings import (
    BalancerPolicyName,
    BalancerSettings,
    DegradationSettings,
    DisaggregationSettings,
    JffcPerRequestSettings,
    KvCostSettings,
    PrefixAffinitySettings,
    QueueSettings,
    ScoreSettings,
    SlotSettings,
    SpeedSettings,
)
from shared.settings_base import ConfigError, PositiveFloat, PositiveInt, Section

# The balancer's sections live in their own module; importers name them from here, as every other section.
__all__ = [
    "BalancerPolicyName", "BalancerSettings", "DegradationSettings", "DisaggregationSettings", "JffcPerRequestSettings",
    "KvCostSettings", "PrefixAffinitySettings", "QueueSettings", "ScoreSettings", "SlotSettings", "SpeedSettings",
    "ConfigError", "PositiveFloat", "PositiveInt", "Section",
    "NatsSettings", "RedisSettings", "LoggingSettings", "TracingSettings", "ClusterSettings", "AuthSettings",
    "IngressSettings", "CacheManagerSettings", "HealthSettings", "SimSettings", "VllmSettings", "WorkerSettings",
    "PoolBounds", "ModelPoolBounds", "AutoscalerSettings", "SupervisionSettings", "KvlaneConfig", "ENV_PREFIX", "CONFIG_FILE_ENV",
    "load_config", "to_env", "TENANT_HEADER",
]

ENV_PREFIX = "KVLANE__"
# The header a request without an API key names its tenant in, unless `ingress.tenant_header` says another.
TENANT_HEADER = "x-tenant"
CONFIG_FILE_ENV = "KVLANE_CONFIG"

class NatsSettings(Section):
    url: str = "nats://127.0.0.1:4222"
    connect_timeout_s: PositiveFloat = 2.0
    reconnect_wait_s: PositiveFloat = 0.5
    # -1: keep reconnecting for ever; a service outlives a NATS restart.
    max_reconnect_attempts: int = -1
    # A server that stops answering (a host gone, no TCP reset) is left for
    # another of `url`'s after this many unanswered pings this far apart.
    ping_interval_s: PositiveFloat = 5.0
    max_outstanding_pings: PositiveInt = 2
    # At shutdown, how long subscriptions may take to finish the messages they
    # already hold before the connection closes anyway (nats-py's own is 30 s,
    # as long as a typical orchestrator waits before SIGKILL).
    drain_timeout_s: PositiveFloat = 10.0
    # Credentials (docs/security.md): a user and password, an NKey seed file, or
    # a `.creds` file (JWT and seed); empty: connect anonymously.
    user: str = ""
    password: str = ""
    nkeys_seed_file: str = ""
    credentials_file: str = ""
    # Where this connection's replies arrive; with subject permissions, each
    # user's own (`_INBOX.<user>`), so no user may read another's replies.
    inbox_prefix: str = "_INBOX"
    # TLS: the CA that signed the server's certificate (TLS on when set), and
    # a client certificate and key where the server verifies clients.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def servers(self) -> list[str]:
        """`url` may list several servers, comma-separated (the client tries them all)."""
        return [part.strip() for part in self.url.split(",") if part.strip()]


class RedisSettings(Section):
    url: str = "redis://127.0.0.1:6379/0"
    # "cluster": `url` names any node of a Redis Cluster; the client finds the others and routes each
    # command, script and pipelined script to its keys' node. Only scripts whose keys share one slot
    # can run there: the per-key rate limits' (`{key:<id>}`), the block ledger's and the slot store's
    # (`{node:<worker_id>}`).
    mode: Literal["single", "cluster"] = "single"
    socket_timeout_s: PositiveFloat = 2.0
    max_connections: PositiveInt = 32
    # How long a command may wait for a free pooled connection under a burst.
    pool_timeout_s: PositiveFloat = 10.0
    # An ACL user and password (or `requirepass` with the password alone); they
    # override any in the URL (`redis://user:password@host:port/0`).
    username: str = ""
    password: str = ""
    # TLS (`rediss://`, also implied by tls_ca): the CA that signed the server's
    # certificate, and a client certificate and key where the server asks for one.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""


class LoggingSettings(Section):
    format: Literal["json", "console"] = "json"
    level: Literal["debug", "info", "warning", "error"] = "info"


class TracingSettings(Section):
    # "otlp" sends spans and the GenAI server metrics over OTLP/HTTP (protobuf);
    # "console" prints spans only; "none" records nothing (no cost per request).
    exporter: Literal["none", "console", "otlp"] = "none"
    # A base URL (`/v1/traces` and `/v1/metrics` are added), or the full traces
    # URL ending in `/v1/traces` (metrics then go to its `/v1/metrics` sibling).
    otlp_endpoint: str = "http://127.0.0.1:4318"
    sample_ratio: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    # Finished spans wait at most this long before they are sent in a batch.
    batch_delay_s: PositiveFloat = 5.0
    # The GenAI server metrics are sent this often (and once more at shutdown).
    metrics_interval_s: PositiveFloat = 60.0


class ClusterSettings(Section):
    heartbeat_interval_s: PositiveFloat = 1.0
    heartbeat_ttl_s: PositiveFloat = 3.0
    # How often a process re-reads the live node set from Redis, besides
    # listening to heartbeats (recovers the view after a restart).
    resync_interval_s: PositiveFloat = 2.0
    # Workers publish prefix-cache changes in batches this far apart.
    kv_events_interval_s: PositiveFloat = 0.05
    # Workers renew the KV leases of running requests this often.
    lease_renew_interval_s: PositiveFloat = 2.0
    # Between full heartbeats a worker sends its load only, without the registration (which
    # rarely changes): it sends the full one on start, on each change, and every this many
    # heartbeats, so a receiver that missed one catches up. 1: every heartbeat is full.
    full_heartbeat_every: PositiveInt = 10


class AuthSettings(Section):
    """API keys at the ingress (shared/api_keys.py, docs/design.md "API keys and tenants")."""

    # Off: no key is needed or checked. On: every /v1 request (HTTP and NATS) needs `Authorization: Bearer <key>`.
    required: bool = False
    # Static keys beside Redis's: a TOML ([[keys]] tables) or .json file of key hashes and their policy, re-read when it changes.
    keys_file: str = ""
    # Key records are cached this long per ingress: a revoked key stops working within it.
    cache_ttl_s: PositiveFloat = 2.0
    # A running request's concurrency slot expires this long after its ingress last renewed it
    # (every third of it): the safety net for an ingress that crashed holding slots.
    slot_ttl_s: PositiveFloat = 30.0


class IngressSettings(Section):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    ingress_id: str = ""
    # Processes serving the port together (SO_REUSEPORT: the kernel spreads connections
    # over them), each with its own NATS connection and ingress id `<ingress_id>-<k>`;
    # siblings under a supervising process that restarts any that exits. Linux only.
    processes: PositiveInt = 1
    auth: AuthSettings = msgspec.field(default_factory=AuthSettings)
    request_timeout_s: PositiveFloat = 600.0
    route_timeout_s: PositiveFloat = 5.0
    # While no balancer answers (none running, or every replica silent: one restarting), a route request is
    # held this long, within its deadline, and asked again as soon as a balancer heartbeats; then 503.
    balancer_wait_s: Annotated[float, Meta(ge=0)] = 5.0
    accept_timeout_s: PositiveFloat = 2.0
    # The route request carries the worker's request, and the balancer sends it on as it decides: one NATS
    # round trip fewer before the first token. Two-node chains and degraded requests are still sent from here.
    balancer_hands_over: bool = True
    # A stream with no frame for this long is failed (worker stalled or gone).
    stall_timeout_s: PositiveFloat = 30.0
    dispatch_attempts: PositiveInt = 3
    # Resumptions of a broken-off stream on another worker before giving up.
    migration_attempts: Annotated[int, Meta(ge=0)] = 2
    # Of those, resumptions after the node running the request died (its process gone or restarted). A
    # request that takes down whatever runs it would otherwise take `migration_attempts + 1` nodes down.
    node_loss_resumes: Annotated[int, Meta(ge=0)] = 1
    # Resumptions after being preempted for a higher-priority request.
    preemption_resumes: Annotated[int, Meta(ge=0)] = 10
    # While waiting for a frame, how often to check that the worker is still alive; and while waiting
    # for a route, that the balancer replica asked is (services/ingress/balancers.py).
    liveness_check_s: PositiveFloat = 0.25
    # After a NATS reconnect, a stream silent this long is resumed (its frames were lost).
    reconnect_grace_s: PositiveFloat = 1.0
    # A stream this many times slower than its node's norm is reported as slow.
    slow_stream_factor: PositiveFloat = 4.0
    max_tokens_default: PositiveInt = 512
    max_body_bytes: PositiveInt = 8 * 1024 * 1024
    # Who a request without an API key is from, for the balancers' fair sharing: this header's value
    # (a GIE fairness id, say); "" or no header: the one key-less tenant. A key's tenant wins over it.
    tenant_header: str = TENANT_HEADER
    # Weights of tenants named by the header (unnamed: 1); a key's tenant has its key's weight.
    tenant_weights: dict[str, Annotated[float, Meta(gt=0.0)]] = {}
    # How many leading prompt tokens ride along for hot-prefix pre-warming.
    forward_prefix_tokens: Annotated[int, Meta(ge=0)] = 2048
    # Where tokenizer files fetched from the bus are kept (a model whose directory this host
    # lacks: shared/model_store.py). Empty: $XDG_CACHE_HOME/kvlane/model-files (~/.cache/...).
    model_cache_dir: str = ""
    # HTTP hardening (services/ingress/http_guard.py). A request head (request line and
    # headers) must arrive whole within header_timeout_s of its first byte (of the
    # connection's opening, for the first request), its body within body_timeout_s of
    # the head, or the client gets 408 and the connection is closed (slowloris).
    header_timeout_s: PositiveFloat = 10.0
    body_timeout_s: PositiveFloat = 60.0
    # An idle keep-alive connection is closed after this long.
    keepalive_timeout_s: PositiveFloat = 75.0
    # Longest request line, longest header line, most headers: beyond them 431 (or 414).
    max_line_size: PositiveInt = 8190
    max_field_size: PositiveInt = 8190
    max_headers: PositiveInt = 128
    # Open connections, in all and per client address, and completions in flight per
    # client address; over a limit the request gets 429 with Retry-After. 0: no limit
    # (behind a proxy every client has the proxy's address).
    max_connections: Annotated[int, Meta(ge=0)] = 4096
    max_connections_per_client: Annotated[int, Meta(ge=0)] = 1024
    max_streams_per_client: Annotated[int, Meta(ge=0)] = 512
    # How long a stored response (`/v1/responses` with `store`) can be continued or fetched, from any replica.
    responses_ttl_s: PositiveFloat = 24 * 3600.0


class CacheManagerSettings(Section):
    lease_ttl_s: PositiveFloat = 10.0
    # Output tokens reserved up front per request: min(max_tokens, this).
    output_reserve_cap: PositiveInt = 1 << 30
    short_request_tokens: PositiveInt = 1024
    short_pool_share: Annotated[float, Meta(ge=0.0, lt=1.0)] = 0.1
    length_penalty_tokens: PositiveFloat = 4096.0
    length_penalty_power: PositiveFloat = 1.0
    eviction: Literal["retention", "lru"] = "retention"
    index_max_blocks: PositiveInt = 1_000_000
    # Nodes that publish no KV events: remember what was routed there this long.
    history_ttl_s: PositiveFloat = 120.0
    prewarm: bool = True
    prewarm_window_s: PositiveFloat = 30.0
    prewarm_min_hits: PositiveInt = 20
    prewarm_prefix_tokens: PositiveInt = 2048
    # Pre-warm onto another node when every holder is above the high load
    # and the target is below the low load (reserved fraction of its blocks).
    prewarm_high_load: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.7
    prewarm_low_load: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.3
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    metrics_host: str = "127.0.0.1"


class HealthSettings(Section):
    # The prober's id (its stream subject; with subject permissions, its user's). Empty: a random one.
    prober_id: str = ""
    probe_interval_s: PositiveFloat = 2.0
    probe_timeout_s: PositiveFloat = 2.0
    # A probe slower than max(factor x the node's baseline, baseline + floor) is bad.
    slow_factor: PositiveFloat = 5.0
    slow_floor_s: PositiveFloat = 0.25
    bad_probes_to_suspect: PositiveInt = 2
    bad_probes_to_unhealthy: PositiveInt = 4
    good_probes_to_recover: PositiveInt = 3
    feedback_window_s: PositiveFloat = 30.0
    feedback_to_suspect: PositiveInt = 5
    suspect_weight: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.3
    verdict_ttl_s: PositiveFloat = 30.0
    # Prometheus /metrics on this port; 0 = off.
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    metrics_host: str = "127.0.0.1"


class SimSettings(Section):
    profile: str = "tiny-cpu"
    # Simulated seconds per real second: 10 runs ten times faster than the GPU.
    speed: PositiveFloat = 1.0
    num_blocks: PositiveInt = 4096
    block_size: PositiveInt = 16
    max_num_seqs: PositiveInt = 64
    max_batched_tokens: PositiveInt = 2048
    max_model_len: PositiveInt = 4096
    seed: int = 0
    # The link KV travels over from a prefill node (shared/kv/links.py).
    kv_link: str = "rdma-400g"
    # The tokenizer ingress encodes this worker's prompts with: "" the sim's own; "hf:<model dir>"
    # a real model's (its token counts, prefix hashes and chat template; a vocabulary within the
    # sim's 32,000 ids, such as `kvlane make-tiny-model`'s). The output stays the sim's words.
    tokenizer: str = ""
    # Fault injection for tests: the engine dies once it has generated this many tokens (0: never).
    fail_after_tokens: Annotated[int, Meta(ge=0)] = 0
    # What loading a LoRA adapter costs the sim: into a batch slot from host memory, and into host memory
    # (from the fetched files) before that, in the modelled GPU's seconds.
    adapter_activate_s: Annotated[float, Meta(ge=0.0)] = 0.002
    adapter_load_s: Annotated[float, Meta(ge=0.0)] = 0.05
    # How chat answers are parsed into tool calls, as `vllm serve --tool-call-parser` (and
    # --enable-auto-tool-choice): "kvlane_sim" reads the sim's own `<tool_call>` format; empty turns tool
    # calls off (tool_choice "auto", "required" and named are then refused, as vLLM refuses them).
    tool_call_parser: str = "kvlane_sim"


class LoraSettings(Section):
    """LoRA adapters a worker serves on its base model (published with `kvlane adapters add`)."""

    # Adapters a batch runs with at once, as vLLM's --max-loras; 0: the worker serves no adapter.
    max_loras: Annotated[int, Meta(ge=0)] = 0
    # Adapters kept loaded in host memory, as vLLM's --max-cpu-loras (0: as many as max_loras).
    max_cpu_loras: Annotated[int, Meta(ge=0)] = 0
    # The largest adapter rank the engine takes, as vLLM's --max-lora-rank.
    max_lora_rank: PositiveInt = 16
    # Where fetched adapters are written. Empty: $XDG_CACHE_HOME/kvlane/adapters (~/.cache/...).
    cache_dir: str = ""


class VllmSettings(Section):
    # A local Hugging Face model directory (config.json, safetensors, tokenizer).
    # Empty: `kvlane up --engine vllm` builds the tiny test model and fills this in.
    model: str = ""
    # The name clients ask for; empty means `worker.model`.
    served_model_name: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # 0: the model's own limit (max_position_embeddings).
    max_model_len: Annotated[int, Meta(ge=0)] = 0
    # The CPU backend wants multiples of 32; kvlane hashes blocks of this size too.
    block_size: PositiveInt = 32
    # KV cache size, passed to vLLM as kv_cache_memory_bytes (CPU and GPU alike;
    # it overrides gpu_memory_utilization). 0: on a GPU, vLLM's own sizing; on
    # the CPU, VLLM_CPU_KVCACHE_SPACE if set, else 4 GiB.
    kv_cache_gib: Annotated[float, Meta(ge=0)] = 0.0
    enable_prefix_caching: bool = True
    tensor_parallel_size: PositiveInt = 1
    # Where a prefill or decode worker's engine serves its NIXL metadata (the
    # handshake before a KV pull): an address the other role's workers reach,
    # and a port of its own per engine; 0 picks a free port at start.
    nixl_side_channel_host: str = "127.0.0.1"
    nixl_side_channel_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    # Any other vllm.AsyncEngineArgs fields, passed through unchanged.
    extra_engine_args: dict[str, Any] = {}
    # How the model's output is parsed into tool calls and reasoning, as `vllm serve --tool-call-parser`,
    # `--reasoning-parser` and `--enable-auto-tool-choice` (empty: not parsed). As in vLLM, the tool-call parser
    # is used only with enable_auto_tool_choice, which needs one.
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    enable_auto_tool_choice: bool = False
    # The chat template requests are rendered with, as `vllm serve --chat-template`: a jinja file's path, or the
    # template itself (decided as vLLM decides). Empty: the model's own. The worker then advertises (and publishes
    # on the bus) a copy of the model's tokenizer files that renders with it (services/worker/served_tokenizer.py).
    chat_template: str = ""


class WorkerSettings(Section):
    worker_id: str = ""
    model: str = "kvlane-sim"
    engine: Literal["sim", "vllm"] = "sim"
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    # An aggregated worker that also exposes its cached prefixes' KV to other workers and pulls theirs (vLLM's
    # NixlConnector as `kv_both`; the sim engine over `sim.kv_link`): balancers may then run a request here on a
    # prefix pulled from a busy worker that caches it, rather than compute it again (docs/design.md, "Prefix pulls
    # between aggregated nodes").
    kv_share: bool = False
    # The step-time profile this worker advertises to balancers (a name, or
    # file:<path> written by `kvlane calibrate`). Empty: a sim worker
    # advertises its own profile, a vLLM worker none (balancers then measure
    # it against balancer.speed.fallback_profile).
    step_profile: str = ""
    drain_timeout_s: PositiveFloat = 30.0
    # A prefill node holds a prompt's KV this long for its decode node to pull
    # it; blocks nobody pulled (the decode node died) are freed then.
    kv_hold_timeout_s: PositiveFloat = 30.0
    # How long a prefill node waits for its decode node to accept the hand-off.
    handoff_timeout_s: PositiveFloat = 5.0
    # Pulls of one KV reference before a decode node prefills the prompt itself.
    kv_pull_attempts: PositiveInt = 2
    # A live source answers a pull in milliseconds; one that died just now
    # may leave the request unanswered rather than refused.
    kv_pull_timeout_s: PositiveFloat = 1.0
    # Prometheus /metrics on this port; 0 = off. Each worker on one host needs its own
    # (KVLANE__WORKER__METRICS_PORT per process); the fleet-wide engine metrics are on ingress.
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    metrics_host: str = "127.0.0.1"
    # Simulated nodes this process hosts (sim engine only): each with its own id
    # (`<worker_id>-<k>`), heartbeats, KV events, inbox and scheduler, on one NATS connection.
    nodes: PositiveInt = 1
    sim: SimSettings = msgspec.field(default_factory=SimSettings)
    vllm: VllmSettings = msgspec.field(default_factory=VllmSettings)
    lora: LoraSettings = msgspec.field(default_factory=LoraSettings)

    @property
    def served_model(self) -> str:
        """The model name this worker registers, the one clients ask for."""
        return (self.vllm.served_model_name or self.model) if self.engine == "vllm" else self.model

    @property
    def shares_kv(self) -> bool:
        """Whether this worker lends and pulls cached prefixes: `kv_share` holds for aggregated workers only."""
        return self.kv_share and self.role == "aggregated"


class PoolBounds(Section):
    min: Annotated[int, Meta(ge=0)] = 1
    max: Annotated[int, Meta(ge=0)] = 8


class ModelPoolBounds(Section):
    """One base model's own bounds for some of its pools; a pool left out keeps its role's (`[autoscaler.<pool>]`)."""

    aggregated: PoolBounds | None = None
    prefill: PoolBounds | None = None
    decode: PoolBounds | None = None


class AutoscalerSettings(Section):
    """Targets and pacing of `services.autoscaler` (defaults after Dynamo's SLA planner and Knative's windows)."""

    ttft_p99_s: PositiveFloat = 0.5
    tpot_p99_s: PositiveFloat = 0.05
    # A pool is saturated at this KV usage, or this many requests waiting per replica (llm-d: 0.8 and 5).
    kv_usage_max: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.8
    waiting_per_replica_max: PositiveFloat = 5.0
    interval_s: PositiveFloat = 5.0
    stable_window_s: PositiveFloat = 60.0
    panic_window_s: PositiveFloat = 6.0
    # Pressure (observed over target) over the panic window that scales up at once, by panic_step.
    panic_threshold: PositiveFloat = 2.0
    step: PositiveInt = 1
    panic_step: PositiveInt = 2
    # Scale down only when one replica fewer would still run below this pressure.
    scale_down_pressure: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.7
    # After a change, wait this long before the next change up (new replicas must start first) or down.
    up_cooldown_s: Annotated[float, Meta(ge=0.0)] = 15.0
    down_cooldown_s: Annotated[float, Meta(ge=0.0)] = 60.0
    # A pool whose min is 0 goes to zero once nothing ran, waited or was served for this long; a request for its
    # model then waits in a balancer's queue (at most balancer.queue.max_wait_s) while a worker starts.
    idle_to_zero_s: PositiveFloat = 300.0
    aggregated: PoolBounds = msgspec.field(default_factory=PoolBounds)
    prefill: PoolBounds = msgspec.field(default_factory=PoolBounds)
    decode: PoolBounds = msgspec.field(default_factory=PoolBounds)
    # Every base model has a pool of each role, bounded as above unless named here: `[autoscaler.models."<model>".
    # aggregated] min = 0` lets a rarely used model's pool go to zero while the others keep theirs.
    models: dict[str, ModelPoolBounds] = msgspec.field(default_factory=dict)
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    metrics_host: str = "127.0.0.1"

    def bounds(self, model: str, pool: str) -> PoolBounds:
        """The min and max of `model`'s pool of role `pool`."""
        own = self.models.get(model)
        bounds = getattr(own, pool) if own is not None else None
        return bounds if bounds is not None else getattr(self, pool)


class SupervisionSettings(Section):
    """How `kvlane up` restarts a process that exited on its own (shared/restarts.py)."""

    # The wait before a restart doubles with each exit in a row, from the first delay up to the max.
    first_delay_s: PositiveFloat = 0.5
    max_delay_s: PositiveFloat = 30.0
    # A process that ran this long before it exited was healthy: its next restart waits the first delay again.
    stable_after_s: PositiveFloat = 60.0
    # Restarts in a row, each ended within stable_after_s, before kvlane up gives up and stops the fleet (0: never restart).
    restart_limit: Annotated[int, Meta(ge=0)] = 5


class KvlaneConfig(Section):
    nats: NatsSettings = msgspec.field(default_factory=NatsSettings)
    redis: RedisSettings = msgspec.field(default_factory=RedisSettings)
    logging: LoggingSettings = msgspec.field(default_factory=LoggingSettings)
    tracing: TracingSettings = msgspec.field(default_factory=TracingSettings)
    cluster: ClusterSettings = msgspec.field(default_factory=ClusterSettings)
    ingress: IngressSettings = msgspec.field(default_factory=IngressSettings)
    balancer: BalancerSettings = msgspec.field(default_factory=BalancerSettings)
    cache_manager: CacheManagerSettings = msgspec.field(default_factory=CacheManagerSettings)
    health: HealthSettings = msgspec.field(default_factory=HealthSettings)
    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
    autoscaler: AutoscalerSettings = msgspec.field(default_factory=AutoscalerSettings)
    supervision: SupervisionSettings = msgspec.field(default_factory=SupervisionSettings)


def _parse_env_value(raw: str) -> Any:
    # Only quoted strings, lists and tables are JSON: a bare 123 stays a
    # string here (a worker id may be "123") and becomes a number later only
    # where the field is numeric.
    if raw[:1] in ('"', "[", "{"):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if not all(path):
            raise ConfigError(f"environment variable {name}: empty key segment")
        node = tree
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"environment variable {name}: {part} is both a value and a section")
            node = child
        node[path[-1]] = _parse_env_value(raw)
    return tree


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> KvlaneConfig:
    """Read the file (if any), apply environment overrides, validate strictly."""
    env = os.environ if env is None else env
    path = path or env.get(CONFIG_FILE_ENV) or None
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        source = str(path)
        try:
            data = tomllib.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    overrides = _env_overrides(env)
    if overrides:
        source += " + KVLANE__* environment"
    try:
        # strict=False lets environment strings such as "8001" become ints.
        return msgspec.convert(_merge(data, overrides), KvlaneConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration ({source}): {exc}") from exc


def to_env(config: KvlaneConfig) -> dict[str, str]:
    """Flatten a config into KVLANE__* variables (how `kvlane up` configures children)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        # Sections become one variable per key; any other value (including a
        # free-form table such as extra_engine_args) is one JSON value, so its
        # keys keep their case and its values their types.
        if isinstance(value, Struct):
            for key in value.__struct_fields__:
                walk(f"{prefix}__{key.upper()}" if prefix else key.upper(), getattr(value, key))
        else:
            flat[ENV_PREFIX + prefix] = json.dumps(msgspec.to_builtins(value))

    walk("", config)
    return flat
