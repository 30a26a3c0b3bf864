"""Admin messages of the balancer (`kvlane.v1.balancer.status`, msgpack request/reply), and its heartbeat."""

from __future__ import annotations

from msgspec import Struct

from contracts.messages import Compact, ErrorReply, NonNegativeInt


class BalancerStatusRequest(Struct, tag="balancer_status_request", tag_field="type"):
    # Chains of this model only; "" = every model.
    model: str = ""
    # A prompt's chained block hashes (as in `RouteRequest`): each chain's
    # `cached_blocks` then says how many of them, from the first, its node
    # holds by this balancer's prefix index. Which node would serve this
    # prompt from cache, as the routing policies see it.
    block_hashes: list[int] = []


class BalancerHeartbeat(Struct, tag="balancer_heartbeat", tag_field="type"):
    """A balancer replica is alive and answers route requests on `subjects.balancer_route(balancer_id)`.

    An ingress sends each route request to one replica it heard from lately; a replica it has not heard
    from for `cluster.heartbeat_ttl_s` (frozen, partitioned, dead) gets no more, and the route requests
    it holds are asked again elsewhere rather than after the route timeout.
    """

    balancer_id: str
    # Sent once as the replica stops taking route requests: forget it at once.
    stopping: bool = False


class ChainStatus(Struct):
    chain_id: str
    worker_id: str
    model: str
    running: NonNegativeInt
    waiting: NonNegativeInt
    slots_used: NonNegativeInt
    slots_total: NonNegativeInt
    kv_usage: float
    speed: float  # relative to the fallback profile
    speed_measured: bool
    health_weight: float
    queue_growth_per_s: float
    # Typical requests per second one slot completes at full occupancy.
    rate_per_slot: float
    # A prefill node is listed too, but only aggregated and decode nodes hold slots.
    role: str = "aggregated"
    # Of the request's `block_hashes`, the leading blocks this node holds (0 when none were given).
    cached_blocks: NonNegativeInt = 0


class QueueClass(Struct):
    priority: int
    length: NonNegativeInt


class BalancerStatus(Compact, tag="balancer_status", tag_field="type"):
    balancer_id: str
    policy: str
    slot_store: str
    chains: list[ChainStatus]
    queue: list[QueueClass]
    queue_length: NonNegativeInt
    oldest_wait_s: float
    # Measured route requests per second (moving average).
    arrival_rate_per_s: float
    reservations_held: NonNegativeInt
    fast_forwards: NonNegativeInt
    # Mean response time of JFFC at the measured arrival rate (inf: overloaded; None: no data).
    bound_lower_s: float | None = None
    bound_upper_s: float | None = None
    recommended_slots_per_chain: int | None = None
    recommended_lower_s: float | None = None
    # `queue_length` by the model the requests ask for: the autoscaler sizes each model's pools on its own.
    queued_per_model: dict[str, NonNegativeInt] = {}


BalancerStatusReply = BalancerStatus | ErrorReply
