"""Wire values that would harm a receiver never decode (found by tests/integration/test_fuzz_nats.py)."""

from __future__ import annotations

import math

import msgspec
import pytest

from contracts.messages import GenerateRequest, Heartbeat, RouteRequest, SamplingParams, WorkerRequest
from tests.unit.balancer_fixtures import heartbeat


def route(timeout_s: float) -> bytes:
    return msgspec.msgpack.encode(RouteRequest(request_id="r", model="m", prompt_tokens=1, max_tokens=1, timeout_s=timeout_s))


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, -math.inf, -1.0, 1e12])
def test_times_left_are_finite_and_not_negative(timeout_s: float) -> None:
    # A NaN or infinite time left becomes a timer (worker, balancer queue) or an int() (slot store): refused at decode.
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(route(timeout_s), type=RouteRequest)
    assert msgspec.msgpack.decode(route(30.0), type=RouteRequest).timeout_s == 30.0


@pytest.mark.parametrize("stream_to", ["", "a b", "kvlane.v1.>", "kvlane..x", "kvlane.*.x", "a." * 200])
def test_subjects_kvlane_publishes_to_are_plain_subjects(stream_to: str) -> None:
    # A bad inbox in one heartbeat made the health prober's whole probe round fail (nats BadSubjectError).
    request = GenerateRequest(request_id="r", model="m", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1),
                              stream_to=stream_to, timeout_s=30.0)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=WorkerRequest)


@pytest.mark.parametrize("field", ["inbox", "started_at"])
def test_a_heartbeat_with_a_bad_registration_does_not_decode(field: str) -> None:
    hb = heartbeat("a")
    bad = {"inbox": "not a subject", "started_at": math.inf}[field]
    # Structs are checked when decoded, not when built: this one encodes as a peer with a bad registration would send it.
    value = msgspec.structs.replace(hb, registration=msgspec.structs.replace(hb.registration, **{field: bad}))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(value), type=Heartbeat)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(hb), type=Heartbeat) == hb
