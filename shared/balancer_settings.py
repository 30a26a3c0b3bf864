"""The balancer's configuration sections (`[balancer]` and its subsections of kvlane.toml).

Read through `shared.config`, like every section: this module only keeps
the largest group of them apart.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from shared.settings_base import PositiveFloat, PositiveInt, Section

BalancerPolicyName = Literal[
    "round_robin", "random", "least_loaded", "power_of_two", "prefix_affinity", "kv_cost", "score", "jffc",
    "jffc_per_request", "lora_affinity",
]


class SlotSettings(Section):
    # A chain's slots = how many requests of this size (prompt + output) its
    # KV memory holds; the typical split also feeds the response-time bounds.
    typical_prompt_tokens: PositiveInt = 768
    typical_output_tokens: PositiveInt = 256
    # Size KV slots by the requests actually routed (a moving average of
    # prompt + max_tokens), the typical size above being only the start:
    # slots sized for smaller requests than arrive overcommit KV, and the
    # engine then preempts and recomputes.
    learn_request_size: bool = True
    # 0: no cap; otherwise slots = min(KV slots, this). The engine's
    # max_num_seqs, when its registration reports it, caps them too.
    max_per_chain: Annotated[int, Meta(ge=0)] = 0
    # "redis": one global count shared by every balancer replica (Lua);
    # "local": this process only (one replica, or tests without Redis).
    store: Literal["redis", "local"] = "redis"
    # False: no admission control, as a plain load balancer in front of the
    # engines: any node takes any number of requests (the excess waits in
    # the engine's own queue) and the central queue stays empty. For
    # comparisons with such gateways, not for production.
    bounded: bool = True


class QueueSettings(Section):
    max_length: PositiveInt = 1024
    # A queued request is refused (503) after this long, or at its own deadline if sooner.
    max_wait_s: PositiveFloat = 30.0
    retry_after_s: PositiveFloat = 1.0
    # When slots free, serve first the queued requests (of the oldest
    # `cache_aware_window` in each priority class) whose prompt prefix the
    # free nodes cache best, instead of strictly the oldest. A request that
    # enough younger ones have overtaken is served ahead of them all, oldest
    # first, so none starves: `cache_aware_max_skips`, or
    # `cache_aware_max_delay_s` worth of departures if more
    # (`Router.overtake_bound`). (A bound on the request's whole wait would
    # not do: under overload every request waits longer than any such bound,
    # which would turn the cache off exactly when it saves most.)
    cache_aware_dequeue: bool = True
    cache_aware_window: PositiveInt = 64
    cache_aware_max_skips: PositiveInt = 16
    # 2 s, the order of an interactive TTFT target: at 0.5 s the bound
    # served most of a long queue oldest first, and the cache hits it gave
    # up cost more waiting than the overtakes saved; 2 s raised SLO
    # attainment on every cached workload measured, with TTFT p99 lower or
    # within 0.01 s (docs/benchmarks.md, "How long a queued request may be
    # overtaken").
    cache_aware_max_delay_s: PositiveFloat = 2.0
    # Within a priority class, serve the oldest request of the tenant served
    # least so far (services/balancer/fair_share.py, VTC): a tenant that
    # bursts cannot take every slot that frees from the others. Service is
    # counted in tokens, a prompt token at `fair_share_prompt_cost`, an output
    # token at `fair_share_output_cost` (VTC's 1 and 2: a generated token
    # costs a step, a prompt token a share of one), divided by the tenant's
    # weight. Off: arrival order, whoever's.
    fair_share: bool = True
    fair_share_prompt_cost: Annotated[float, Meta(ge=0.0)] = 1.0
    fair_share_output_cost: Annotated[float, Meta(ge=0.0)] = 2.0


class SpeedSettings(Section):
    # Step-time profile (shared/kv/step_profile.py) assumed for a node
    # until its heartbeats show measured speed.
    fallback_profile: str = "tiny-cpu"
    # Weight of the newest measurement in the moving averages (speed, queue growth).
    smoothing: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.3
    # A node whose waiting queue grows counts as if it were this many seconds ahead.
    growth_horizon_s: Annotated[float, Meta(ge=0.0)] = 2.0
    # Measured speeds within this fraction of each other count as one speed:
    # identical nodes measure differently (prefill/decode mix, idle moments),
    # and ranking on that noise piles requests onto a few of them. 0 = off.
    equal_within: Annotated[float, Meta(ge=0.0)] = 0.5


class PrefixAffinitySettings(Section):
    match_threshold: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.5
    balance_abs_threshold: Annotated[float, Meta(ge=0.0)] = 32.0
    balance_rel_threshold: Annotated[float, Meta(ge=1.0)] = 1.5


class KvCostSettings(Section):
    overlap_weight: Annotated[float, Meta(ge=0.0)] = 1.0


class ScoreSettings(Section):
    load_weight: float = 0.5
    cache_weight: float = 0.3
    fit_weight: float = 0.2
    # Go to the node holding the request's cache while its utilisation is below this.
    fast_forward_utilisation: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.65


class JffcPerRequestSettings(Section):
    # Weight of the delay a placement adds to the requests already running
    # on the node, beside the request's own completion time; 0 ignores it.
    # 2: in a steady state about as many requests join the node during the
    # newcomer's stay as were running when it came (Little's law), and they
    # share its decode steps too; counting only those present undervalued
    # the prefill a cached prefix saves the node (docs/benchmarks.md, "The
    # delay imposed on requests that join later").
    imposed_delay_weight: Annotated[float, Meta(ge=0.0)] = 2.0
    # A request waits in the central queue for a busy node that caches at
    # least this share of its prompt more than any free node does, rather
    # than prefill that share again elsewhere; for at most
    # `queue.cache_aware_max_delay_s` or its overtake bound. 0 never waits.
    # JFFC alone never waits for a busy chain; with cached prompts of
    # thousands of tokens the prefill repeated elsewhere slowed whole
    # batches and evicted other conversations' histories, and under load the
    # caching node frees a slot about as soon (docs/benchmarks.md, "Waiting
    # for the node that caches the prompt").
    cache_hold_share: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.25


class AdapterRoutingSettings(Section):
    """How routing weighs LoRA adapters (services/balancer/adapters.py)."""

    # Cost each node's adapter load (none in a batch slot, a copy from host memory, or a fetch and load) and offer
    # a request only nodes with a batch slot its adapter can take now. Off: any node of the base model that serves
    # adapters, each costed as if the adapter were there (for comparisons).
    aware: bool = True
    # Seconds a load takes where the node has not measured one yet: into host memory and a slot, and into a slot.
    load_s: Annotated[float, Meta(ge=0.0)] = 0.1
    activate_s: Annotated[float, Meta(ge=0.0)] = 0.005
    # A request that would start its adapter on a node where it runs nothing also pays for the batch slot it
    # takes: the seconds an adapter request holds one (`hold_s` until this balancer has measured it) times
    # rho / (1 - rho), rho the share of the fleet's slots running requests. Off: only the load is costed, and
    # requests spread over nodes by speed alone (docs/benchmarks.md, "LoRA adapters").
    price_slots: bool = True
    hold_s: Annotated[float, Meta(ge=0.0)] = 5.0


class DisaggregationSettings(Section):
    # Conditional disaggregation: a request whose uncached prompt part on
    # the chosen decode node is shorter than this is prefilled there, not
    # sent through a prefill node (the hand-off would cost more than it saves).
    min_remote_prefill_tokens: Annotated[int, Meta(ge=0)] = 256
    # When every prefill node would take longer than this to have the prompt ready
    # (their backlog plus the prompt) and the decode node itself would be sooner,
    # the decode node prefills it rather than queueing behind the saturated pool.
    # Off by default: it moves prompts onto decode nodes on an estimate of the backlog.
    local_prefill_when_saturated: bool = False
    prefill_saturated_s: PositiveFloat = 0.5
    # A two-node chain's prompt is ready on the decode node once its KV has
    # crossed the link (the nodes' advertised `kv_transfer`); off: as if it
    # crossed at once (for comparisons).
    cost_kv_transfer: bool = True


class PrefixPullSettings(Section):
    # Between kv_share workers, run a request on a free node with its prefix pulled from a busy node that
    # caches it, when that has the prefix there sooner than computing it again (services/balancer/prefix_pull.py).
    enabled: bool = True
    # A pull of fewer tokens than this is not worth its fixed costs (a step on the source, a round trip):
    # they are computed again. vLLM's NixlConnector recomputes below 64 (`kv_recompute_threshold`) too.
    min_tokens: Annotated[int, Meta(ge=1)] = 64


class DegradationSettings(Section):
    """How the balancer bends under overload, judged by the central queue's predicted wait."""

    # A queue wait predicted beyond this is overload (the TTFT the fleet is meant to keep).
    ttft_target_s: PositiveFloat = 0.5
    # Under overload, requests of a priority below `below_priority` that must queue
    # are given max_tokens x `max_tokens_factor` (never below `min_max_tokens`);
    # the response says so (the `kvlane.degraded` field and an X-Kvlane-Degraded header).
    reduce_max_tokens: bool = False
    below_priority: int = 1
    max_tokens_factor: Annotated[float, Meta(gt=0.0, lt=1.0)] = 0.5
    min_max_tokens: PositiveInt = 16
    # A request whose predicted wait passes its deadline is refused at once with 429
    # and Retry-After rather than after waiting for nothing; the lowest class, with
    # the most ahead of it, is shed first. Off by default: the prediction is an
    # estimate, and a client that does not retry loses a request that might have run.
    shed: bool = False
    # A full queue makes room for a higher class by refusing (429) its newest
    # request of the lowest class below, instead of refusing the newcomer.
    evict_lower_when_full: bool = True
    # Departures (slots freed per second) are measured over this window.
    rate_window_s: PositiveFloat = 10.0


class BalancerSettings(Section):
    policy: BalancerPolicyName = "jffc_per_request"
    # Confirm every decision with a KV lease from the ledger, which the
    # balancer frees again when the request ends (the cache-manager only
    # preempts when the node has no room, and reaps leases nobody freed).
    # Off only for fleets without leases, such as pure routing benchmarks.
    allocate_kv: bool = True
    allocate_timeout_s: PositiveFloat = 2.0
    # Seeds `random` and `power_of_two`, so runs can be replayed.
    seed: int = 0
    # Prometheus /metrics on this port; 0 = off.
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    metrics_host: str = "127.0.0.1"
    # How often expired reservations are dropped, global slot usage re-read and the queue retried.
    tick_interval_s: PositiveFloat = 0.5
    prefix_index_max_blocks: PositiveInt = 1_000_000
    slots: SlotSettings = msgspec.field(default_factory=SlotSettings)
    queue: QueueSettings = msgspec.field(default_factory=QueueSettings)
    speed: SpeedSettings = msgspec.field(default_factory=SpeedSettings)
    prefix_affinity: PrefixAffinitySettings = msgspec.field(default_factory=PrefixAffinitySettings)
    kv_cost: KvCostSettings = msgspec.field(default_factory=KvCostSettings)
    score: ScoreSettings = msgspec.field(default_factory=ScoreSettings)
    jffc_per_request: JffcPerRequestSettings = msgspec.field(default_factory=JffcPerRequestSettings)
    disaggregation: DisaggregationSettings = msgspec.field(default_factory=DisaggregationSettings)
    adapters: AdapterRoutingSettings = msgspec.field(default_factory=AdapterRoutingSettings)
    prefix_pull: PrefixPullSettings = msgspec.field(default_factory=PrefixPullSettings)
    degradation: DegradationSettings = msgspec.field(default_factory=DegradationSettings)
