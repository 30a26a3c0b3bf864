"""A hypothesis-driven fuzzer for every NATS subject kvlane subscribes to.

Each subject gets schema-derived messages (`tests/msgspec_strategies.py`,
from the same msgspec Structs the services decode), near misses of them,
messages of other families, arbitrary msgpack/JSON values and random bytes.
Request/reply subjects must answer every one: bad input with an `ErrorReply`
(status 400) on the internal subjects, with the OpenAI error body and
`Nats-Service-Error-Code` on `kvlane.v1.api.*`; good input with a reply of
the subject's reply type, never an internal error. After each subject every
service still answers, and at the end no service has exited or logged a
crash and the fleet serves a normal request.

Deterministic: hypothesis is derandomized and bounded by example count.
The counts are printed and written to `nats_fuzz.json` in the test's
tmp dir (and asserted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import urllib.request
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import nats
import nats.errors
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from contracts import subjects
from contracts.autoscaler import RequestServed, ScaleUpWanted, ScalingDecision
from contracts.balancer import BalancerStatus, BalancerStatusReply, BalancerStatusRequest
from contracts.cache import CacheReply, CacheRequest, CacheStatus, CacheStatusRequest, PrefixesRouted, RenewLeases
from contracts.health import HealthVerdict, NodeFeedback
from contracts.messages import (
    AbortRequest,
    ErrorReply,
    GenerateRequest,
    HeartbeatMessage,
    KvEvents,
    KvMessage,
    KvPullReply,
    KvRelease,
    RequestFinished,
    RouteReply,
    RouteRequest,
    RouteWithdrawn,
    SamplingParams,
    StreamMessage,
    WorkerLeft,
    WorkerReply,
    WorkerRequest,
)
from contracts.openai_api import ChatCompletionRequest, CompletionRequest, ErrorResponse
from launch.fleet import Fleet, with_overrides
from launch.launcher import wait_ready, wait_services_ready
from shared.runner import READY_EVENT
from tests.integration.conftest import MODEL, launch, stop_and_check, until_status
from tests.msgspec_strategies import json_values, near_misses, wire_values

pytestmark = pytest.mark.integration

EXAMPLES_PER_SUBJECT = 200
REPLY_TIMEOUT_S = 10.0
# Once this many cases went unanswered the test has failed: no more are sent, so that waiting for
# answers cannot spend the test's time limit before the report is written.
UNANSWERED_LIMIT = 5
ERROR_CODE = "Nats-Service-Error-Code"
T = TypeVar("T")

# Crashes and handler failures in a service's log: a fuzz case that causes one is a bug.
CRASH = re.compile(r'"(handler_failed|unhandled_error|http_error)"|Traceback \(most recent call last\)|Task exception was never retrieved')


@dataclass(frozen=True)
class Target:
    """One subject a kvlane service subscribes to, and what it takes and answers."""

    name: str
    subject: str
    takes: Any
    replies: Any = None  # None: publish only
    codec: Literal["msgpack", "json"] = "msgpack"
    # Valid messages of these types get no reply (they are notices, e.g. an abort).
    silent: tuple[type, ...] = ()
    # Field values worth using instead of the schema's random ones (a real model name...).
    hints: dict[str, st.SearchStrategy[Any]] = field(default_factory=dict)


class NatsProbe:
    """A NATS connection on an event loop of its own, for hypothesis' synchronous test bodies."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="nats-probe", daemon=True)
        self._thread.start()
        self.nc: NatsClient = self.run(nats.connect(url, max_reconnect_attempts=0))

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.nc.close(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def _ready_fields(fleet: Fleet, name: str) -> dict[str, Any]:
    process = next(p for p in fleet.services() if p.name == name)
    for line in process.log_path.read_text(errors="replace").splitlines():
        if READY_EVENT in line:
            with contextlib.suppress(ValueError):
                return json.loads(line)
    raise AssertionError(f"{name} announced no ready line")


def targets(fleet: Fleet) -> list[Target]:
    ingress_id = _ready_fields(fleet, "ingress")["ingress_id"]
    prober_id = _ready_fields(fleet, "health-prober")["prober_id"]
    soon = st.floats(0.0, 3.0)  # times left that run out within the test
    model = st.sampled_from([MODEL]) | st.text(max_size=12)
    workers = st.sampled_from(["p0", "d0"]) | st.from_regex(r"^[a-z0-9]{1,8}$", fullmatch=True)
    tokens = st.lists(st.integers(-5, 70_000), min_size=1, max_size=40)
    sink = st.just("kvlane.v1.fuzz.sink") | st.text(max_size=12)  # where a worker streams a fuzzed request's frames
    work = {"model": model, "timeout_s": soon, "hold_s": soon, "prompt_token_ids": tokens, "stream_to": sink,
            "worker_id": workers, "source_worker_id": workers, "decode_worker_id": workers, "puller_id": workers,
            "decode_inbox": st.sampled_from([subjects.worker_inbox("d0")]) | st.text(max_size=12),
            "accept_to": st.sampled_from(["", "kvlane.v1.fuzz.accepted"]) | st.text(max_size=12)}
    api = {"model": model, "max_tokens": st.integers(1, 64) | st.integers(1, 2**40), "max_completion_tokens": st.none() | st.integers(1, 64)}
    return [
        Target("route", subjects.ROUTE, RouteRequest, RouteReply, hints={"model": model, "timeout_s": soon}),
        Target("balancer_status", subjects.BALANCER_STATUS, BalancerStatusRequest, BalancerStatusReply, hints={"model": model}),
        Target("balancer_status_all", subjects.BALANCER_STATUS_ALL, BalancerStatusRequest, BalancerStatusReply),
        Target("cache_request", subjects.CACHE_REQUEST, CacheRequest, CacheReply, hints=work),
        Target("cache_renew", subjects.CACHE_RENEW, RenewLeases),
        Target("cache_routed", subjects.CACHE_ROUTED, PrefixesRouted, hints={"worker_id": workers}),
        Target("events_finished", subjects.REQUEST_FINISHED, RequestFinished),
        Target("events_route_withdrawn", subjects.ROUTE_WITHDRAWN, RouteWithdrawn),
        Target("events_served", subjects.REQUEST_SERVED, RequestServed, hints={"model": model}),
        Target("events_worker_left", subjects.WORKER_LEFT, WorkerLeft),
        # Heartbeats of made-up nodes (never the real ones': a valid heartbeat is believed).
        Target("heartbeat", subjects.heartbeat("fuzz"), HeartbeatMessage, hints={"model": model}),
        Target("kv_events", subjects.kv_events("fuzz"), KvEvents),
        Target("health", subjects.health("fuzz"), HealthVerdict),
        Target("feedback", subjects.FEEDBACK, NodeFeedback),
        Target("autoscaler_decision", subjects.AUTOSCALER_DECISION, ScalingDecision),
        Target("autoscaler_wake", subjects.AUTOSCALER_WAKE, ScaleUpWanted, hints={"model": model}),
        Target("prefill_inbox", subjects.worker_inbox("p0"), WorkerRequest, WorkerReply, silent=(AbortRequest,), hints=work),
        Target("decode_inbox", subjects.worker_inbox("d0"), WorkerRequest, WorkerReply, silent=(AbortRequest,), hints=work),
        Target("prefill_kv", subjects.worker_kv("p0"), KvMessage, KvPullReply, silent=(KvRelease,), hints=work),
        Target("ingress_streams", subjects.stream_subject(ingress_id, "fuzz"), StreamMessage),
        Target("prober_streams", subjects.stream_subject(prober_id, "fuzz"), StreamMessage),
        Target("api_chat_completions", subjects.API_CHAT_COMPLETIONS, ChatCompletionRequest, ErrorResponse, "json", hints=api),
        Target("api_completions", subjects.API_COMPLETIONS, CompletionRequest, ErrorResponse, "json", hints=api),
        Target("api_models", subjects.API_MODELS, Any, ErrorResponse, "json"),
    ]


OTHER_FAMILIES = [RouteRequest, HeartbeatMessage, KvEvents, WorkerRequest, CacheRequest, StreamMessage, HealthVerdict, ScalingDecision]


def payloads(target: Target) -> st.SearchStrategy[bytes]:
    encode = msgspec.json.encode if target.codec == "json" else msgspec.msgpack.encode
    own = wire_values(target.takes, target.hints) if target.takes is not Any else json_values()
    shapes = [own, own, json_values(), st.sampled_from(OTHER_FAMILIES).flatmap(wire_values)]
    if target.takes is not Any:
        shapes.append(near_misses(target.takes, target.hints))
    return st.one_of(st.one_of(shapes).map(encode), st.binary(max_size=64))


@dataclass
class Tally:
    cases: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def record(self, target: Target, outcome: str) -> None:
        self.cases[target.name] += 1
        self.outcomes.setdefault(target.name, Counter())[outcome] += 1


def _show(target: Target, payload: bytes, limit: int = 600) -> str:
    """A payload for a failure message: decoded when it decodes at all (what was in it), else its bytes."""
    decode = msgspec.json.decode if target.codec == "json" else msgspec.msgpack.decode
    try:
        return repr(decode(payload))[:limit]
    except (msgspec.DecodeError, ValueError):
        return repr(payload)[:limit]


def _decodes(target: Target, payload: bytes) -> Any:
    decode = msgspec.json.decode if target.codec == "json" else msgspec.msgpack.decode
    try:
        return decode(payload, type=target.takes)
    except (msgspec.DecodeError, ValueError):
        return None


def check_case(probe: NatsProbe, target: Target, payload: bytes, tally: Tally) -> None:
    """Send one payload; for a request/reply subject, check its answer. What happened goes into the tally."""
    if sum(outcomes["unanswered"] for outcomes in tally.outcomes.values()) >= UNANSWERED_LIMIT:
        tally.record(target, "not_sent")
        return
    message = _decodes(target, payload)
    valid = message is not None
    if target.replies is None or (valid and isinstance(message, target.silent)):
        probe.run(probe.nc.publish(target.subject, payload))
        tally.record(target, "published")
        return
    # A request a balancer sent on is answered where its sender waits, not on the message's reply subject.
    answer_at = getattr(message, "accept_to", "")
    try:
        if answer_at:
            reply = probe.run(_answered_at(probe.nc, target.subject, payload, answer_at))
        else:
            reply = probe.run(probe.nc.request(target.subject, payload, timeout=REPLY_TIMEOUT_S))
    except nats.errors.Error as exc:  # no responders, or no answer in time
        tally.failures.append(f"{target.name}: no answer ({type(exc).__name__}) to {_show(target, payload)}")
        tally.record(target, "unanswered")
        return
    if target.codec == "json":
        outcome = _check_api_reply(target, payload, valid, reply.data, reply.headers or {}, tally)
    else:
        outcome = _check_internal_reply(target, payload, valid, reply.data, tally)
    tally.record(target, outcome)


async def _answered_at(nc: NatsClient, subject: str, payload: bytes, answer_at: str) -> Msg:
    answers = await nc.subscribe(answer_at, max_msgs=1)
    try:
        await nc.publish(subject, payload)  # after the subscription on the same connection: the server sees it first
        return await answers.next_msg(timeout=REPLY_TIMEOUT_S)
    finally:
        with contextlib.suppress(nats.errors.Error):
            await answers.unsubscribe()


def _check_internal_reply(target: Target, payload: bytes, valid: bool, data: bytes, tally: Tally) -> str:
    try:
        answer = msgspec.msgpack.decode(data, type=target.replies)
    except msgspec.DecodeError as exc:
        tally.failures.append(f"{target.name}: reply is no {target.replies} ({exc}) to {_show(target, payload)}")
        return "bad_reply"
    if isinstance(answer, ErrorReply):
        if not valid and answer.status != 400:
            tally.failures.append(f"{target.name}: undecodable input answered {answer} to {_show(target, payload)}")
        if answer.status >= 500 and answer.code == "internal":
            tally.failures.append(f"{target.name}: internal error {answer.message!r} for {_show(target, payload)}")
        return f"error_{answer.status}"
    return type(answer).__name__


def _check_api_reply(target: Target, payload: bytes, valid: bool, data: bytes, headers: dict[str, str], tally: Tally) -> str:
    status = headers.get(ERROR_CODE)
    if status is None:
        if target.name != "api_models" and not valid:
            tally.failures.append(f"{target.name}: invalid input answered without an error: {_show(target, payload)}")
        with contextlib.suppress(ValueError):
            json.loads(data)
            return "ok"
        tally.failures.append(f"{target.name}: a reply that is not JSON: {data[:120]!r}")
        return "bad_reply"
    try:
        error = msgspec.json.decode(data, type=ErrorResponse).error
    except msgspec.DecodeError:
        tally.failures.append(f"{target.name}: error {status} without the OpenAI error body: {data[:120]!r}")
        return "bad_reply"
    if int(status) >= 500 and error.code == "internal_error":
        tally.failures.append(f"{target.name}: internal error for {_show(target, payload)}")
    if not valid and int(status) != 400:
        tally.failures.append(f"{target.name}: invalid input answered {status} {error.message!r}")
    return f"error_{status}"


# --- liveness ----------------------------------------------------------------------------------------


async def _typed_request(nc: NatsClient, subject: str, message: msgspec.Struct, reply_type: Any) -> Any:
    reply = await nc.request(subject, msgspec.msgpack.encode(message), timeout=REPLY_TIMEOUT_S)
    return msgspec.msgpack.decode(reply.data, type=reply_type)


async def everyone_answers(nc: NatsClient, fleet: Fleet) -> None:
    """Every service still serves: the balancer, the cache-manager, both workers, the ingress (NATS and HTTP)."""
    status = await _typed_request(nc, subjects.BALANCER_STATUS_ALL, BalancerStatusRequest(model="-"), BalancerStatusReply)
    assert isinstance(status, BalancerStatus), status
    cache = await _typed_request(nc, subjects.CACHE_REQUEST, CacheStatusRequest(), CacheReply)
    assert isinstance(cache, CacheStatus), cache
    for worker in ("p0", "d0"):  # a request for another model: refused at once, by a worker that serves
        ping = GenerateRequest(request_id="ping", model="no-such-model", prompt_token_ids=[1], sampling=SamplingParams(max_tokens=1),
                               stream_to="kvlane.v1.fuzz.sink", timeout_s=5.0)
        answer = await _typed_request(nc, subjects.worker_inbox(worker), ping, WorkerReply)
        assert isinstance(answer, ErrorReply) and answer.code == "model_not_found", answer
    models = await nc.request(subjects.API_MODELS, b"", timeout=REPLY_TIMEOUT_S)
    assert json.loads(models.data)["object"] == "list"
    with urllib.request.urlopen(f"{fleet.base_url}/health", timeout=10) as response:
        assert response.status == 200
    dead = [p.name for p in fleet.services() if not p.alive()]
    assert not dead, f"exited: {dead}"


async def autoscaler_decides(nc: NatsClient) -> None:
    decisions = await nc.subscribe(subjects.AUTOSCALER_DECISION)
    try:
        msg = await decisions.next_msg(timeout=10)
        assert isinstance(msgspec.msgpack.decode(msg.data, type=ScalingDecision), ScalingDecision)
    finally:
        await decisions.unsubscribe()


def normal_request(fleet: Fleet) -> dict:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hello after the fuzzing"}], "max_tokens": 6}).encode()
    request = urllib.request.Request(f"{fleet.base_url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
        return json.loads(response.read())


# --- the test ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Disaggregated, so that both worker roles and the prefill node's KV subject are there; fast sim
    # workers; an autoscaler that decides every second.
    fleet = launch(tmp_path_factory.mktemp("nats-fuzz"), workers=0, prefill_workers=1, decode_workers=1, speed=20.0,
                   tune=lambda c: with_overrides(c, autoscaler={"interval_s": 1.0}))
    try:
        wait_services_ready([fleet.add_autoscaler()], 60)
    except BaseException:
        fleet.stop()
        raise
    yield fleet
    stop_and_check(fleet)


def crash_lines(fleet: Fleet) -> list[str]:
    return [f"{p.name}: {line[:400]}" for p in fleet.services() for line in p.log_path.read_text(errors="replace").splitlines()
            if CRASH.search(line)]


def report(tally: Tally, path: Path) -> None:
    """The counts, printed and written, also when the test stops early (what had been sent by then)."""
    summary = {"subjects": len(tally.cases), "cases": sum(tally.cases.values()), "per_subject": dict(tally.cases),
               "outcomes": {name: dict(c) for name, c in tally.outcomes.items()}, "failures": tally.failures[:50]}
    path.write_text(json.dumps(summary, indent=2))
    print(f"\nNATS fuzzing: {summary['cases']} cases over {summary['subjects']} subjects -> {path}")
    for name, outcomes in tally.outcomes.items():
        print(f"  {name:<24} {tally.cases[name]:>4}  {dict(outcomes)}")


def test_every_subscribed_subject_survives_fuzzing(fleet: Fleet, tmp_path: Path) -> None:
    probe = NatsProbe(fleet.config.nats.url)
    tally = Tally()
    try:
        for target in targets(fleet):
            @settings(max_examples=EXAMPLES_PER_SUBJECT, derandomize=True, database=None, deadline=None,
                      phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
            @given(payload=payloads(target))
            def fuzz(payload: bytes) -> None:
                check_case(probe, target, payload, tally)

            fuzz()
            probe.run(everyone_answers(probe.nc, fleet))
        probe.run(autoscaler_decides(probe.nc))
    finally:
        probe.close()
        report(tally, tmp_path / "nats_fuzz.json")
    assert not tally.failures, "\n".join(tally.failures[:30])
    assert len(tally.cases) == len(targets(fleet)) and min(tally.cases.values()) >= EXAMPLES_PER_SUBJECT // 2
    assert sum(tally.cases.values()) >= 1000
    # Once the made-up nodes have expired, the real ones serve a normal request.
    real = {process.name.removeprefix("worker-") for process in fleet.workers}
    asyncio.run(until_status(fleet, lambda status: {chain.worker_id for chain in status.chains} <= real,
                             timeout_s=10 * fleet.config.cluster.heartbeat_ttl_s))
    wait_ready(fleet.base_url, 30, fleet.services(), min_workers=2)
    assert normal_request(fleet)["usage"]["completion_tokens"] == 6
    crashes = crash_lines(fleet)
    assert not crashes, "\n".join(crashes[:20])
