"""NATS subjects and Redis keys, all under one versioned prefix.

A change that breaks the wire format bumps the version, so that old and new
services on one bus never misread each other's messages.
"""

from __future__ import annotations

import re

PREFIX = "kvlane.v1"
REDIS_PREFIX = "kvlane:v1"

ROUTE = f"{PREFIX}.route"
ROUTE_WITHDRAWN = f"{PREFIX}.events.route_withdrawn"
BALANCER_QUEUE_GROUP = "kvlane-balancer"
BALANCER_STATUS = f"{PREFIX}.balancer.status"
BALANCER_ADMIN_QUEUE_GROUP = "kvlane-balancer-admin"
# Every balancer replica answers here (no queue group): `kvlane status` shows them all.
BALANCER_STATUS_ALL = f"{PREFIX}.balancer.status_all"
# Each balancer replica says it is alive here, about once per `cluster.heartbeat_interval_s`.
BALANCER_HEARTBEAT_ALL = f"{PREFIX}.balancer.heartbeat.*"

HEARTBEAT_ALL = f"{PREFIX}.heartbeat.*"
WORKER_LEFT = f"{PREFIX}.events.worker_left"
KV_EVENTS_ALL = f"{PREFIX}.kv.*"

FEEDBACK = f"{PREFIX}.feedback"
HEALTH_ALL = f"{PREFIX}.health.*"

CACHE_REQUEST = f"{PREFIX}.cache.request"
CACHE_RENEW = f"{PREFIX}.cache.renew"
CACHE_ROUTED = f"{PREFIX}.cache.routed"
CACHE_QUEUE_GROUP = "kvlane-cache-manager"
REQUEST_FINISHED = f"{PREFIX}.events.finished"
REQUEST_SERVED = f"{PREFIX}.events.served"
AUTOSCALER_DECISION = f"{PREFIX}.autoscaler.decision"
AUTOSCALER_DECISION_KEY = f"{REDIS_PREFIX}:autoscaler:decision"
# A balancer holds requests for a model no worker serves (`ScaleUpWanted`): the autoscaler decides at once.
AUTOSCALER_WAKE = f"{PREFIX}.autoscaler.wake"

# The OpenAI API over NATS request/reply (a `nats.micro` service): the payload
# is the OpenAI JSON request body, the reply its JSON response body.
API_SERVICE = "kvlane"
API_QUEUE_GROUP = "kvlane-api"
API_CHAT_COMPLETIONS = f"{PREFIX}.api.chat.completions"
API_COMPLETIONS = f"{PREFIX}.api.completions"
API_MODELS = f"{PREFIX}.api.models"
API_TOKENIZE = f"{PREFIX}.api.tokenize"
API_DETOKENIZE = f"{PREFIX}.api.detokenize"
# The Anthropic Messages API: the payload is its JSON request body; streamed replies carry one event each.
API_MESSAGES = f"{PREFIX}.api.messages"
# The OpenAI Responses API: the payload is its JSON request body; streamed replies carry one event each.
API_RESPONSES = f"{PREFIX}.api.responses"
# Headers of a streamed reply: each chunk's sequence number, and the end of the stream.
API_SEQ_HEADER = "Kvlane-Seq"
API_STREAM_HEADER = "Kvlane-Stream"
API_STREAM_END = "end"

NODE_SET_KEY = f"{REDIS_PREFIX}:nodes"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def is_valid_token(value: str) -> bool:
    """Whether `value` can stand alone as one NATS subject token (ids are used so)."""
    return bool(_TOKEN.match(value))


def balancer_route(balancer_id: str) -> str:
    """Where one balancer replica answers route requests, besides `ROUTE` (its queue group)."""
    return f"{ROUTE}.{balancer_id}"


def balancer_heartbeat(balancer_id: str) -> str:
    return f"{PREFIX}.balancer.heartbeat.{balancer_id}"


def heartbeat(worker_id: str) -> str:
    return f"{PREFIX}.heartbeat.{worker_id}"


def health(worker_id: str) -> str:
    return f"{PREFIX}.health.{worker_id}"


def health_key(worker_id: str) -> str:
    return f"{REDIS_PREFIX}:health:{worker_id}"


def kv_events(worker_id: str) -> str:
    return f"{PREFIX}.kv.{worker_id}"


def worker_inbox(worker_id: str) -> str:
    """Where a worker takes generate and abort requests."""
    return f"{PREFIX}.worker.{worker_id}.generate"


def worker_kv(worker_id: str) -> str:
    """Where a prefill node takes KV pull and release messages from decode nodes."""
    return f"{PREFIX}.worker.{worker_id}.kv"


def stream_inbox(owner_id: str) -> str:
    """Wildcard subject on which one process receives all of its streamed replies."""
    return f"{PREFIX}.stream.{owner_id}.*"


def stream_subject(owner_id: str, request_id: str) -> str:
    return f"{PREFIX}.stream.{owner_id}.{request_id}"


def response_key(response_id: str) -> str:
    """A stored response of the Responses API (`store`): any ingress continues or returns it."""
    return f"{REDIS_PREFIX}:response:{response_id}"


def node_key(worker_id: str) -> str:
    return f"{REDIS_PREFIX}:node:{worker_id}"
