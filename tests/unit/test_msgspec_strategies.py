"""The wire-type strategies draw what the services decode (the NATS fuzzer relies on it)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.autoscaler import RequestServed, ScalingDecision
from contracts.balancer import BalancerStatusRequest
from contracts.cache import CacheRequest, PrefixesRouted, RenewLeases
from contracts.health import HealthVerdict, NodeFeedback
from contracts.messages import (
    Heartbeat, KvEvents, KvMessage, RequestFinished, RouteRequest, RouteWithdrawn, StreamMessage, WorkerLeft, WorkerRequest,
)
from contracts.openai_api import ChatCompletionRequest, CompletionRequest
from tests.msgspec_strategies import encodes_as, near_misses, wire_values

WIRE_TYPES: list[Any] = [
    RouteRequest, RouteWithdrawn, WorkerRequest, KvMessage, StreamMessage, RequestFinished, Heartbeat, KvEvents, WorkerLeft,
    CacheRequest, RenewLeases, PrefixesRouted, NodeFeedback, HealthVerdict, RequestServed, ScalingDecision, BalancerStatusRequest,
]


@pytest.mark.parametrize("tp", WIRE_TYPES, ids=lambda tp: getattr(tp, "__name__", str(tp)))
@settings(derandomize=True, max_examples=60, deadline=None)
@given(data=st.data())
def test_wire_values_decode_as_their_type(tp: Any, data: st.DataObject) -> None:
    value = data.draw(wire_values(tp, {"model": st.just("kvlane-sim")}))
    msgspec.msgpack.Decoder(tp).decode(msgspec.msgpack.encode(value))


@pytest.mark.parametrize("tp", [ChatCompletionRequest, CompletionRequest], ids=lambda tp: tp.__name__)
@settings(derandomize=True, max_examples=60, deadline=None)
@given(data=st.data())
def test_openai_requests_decode_from_json(tp: Any, data: st.DataObject) -> None:
    msgspec.json.decode(msgspec.json.encode(data.draw(wire_values(tp))), type=tp)


def test_near_misses_are_mostly_invalid() -> None:
    seen: list[bool] = []

    @settings(derandomize=True, max_examples=100, deadline=None)
    @given(value=near_misses(RouteRequest))
    def draw(value: Any) -> None:
        seen.append(encodes_as(RouteRequest, value))

    draw()
    # Not all (a dropped optional field is still valid), but the strategy must reach invalid ones.
    assert seen.count(False) > len(seen) // 3
