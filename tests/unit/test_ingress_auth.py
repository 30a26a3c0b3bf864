"""API keys on the ingress's one request path (`Completions` with an `Authenticator`), without servers.

The key store and the limiter are stand-ins here (the Lua limiter has its
own tests against a real Redis, tests/integration/test_key_limits.py); what
is checked is the path: 401/403/429 before anything is dispatched, the
priority clamp and the tenant on the route, the admission settled with the
tokens used however the request ends, and the key never echoed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError

from contracts.messages import StreamEnd, Timings, TokenChunk, Usage
from services.ingress import auth as auth_module
from services.ingress.auth import Authenticator
from services.ingress.completions import CHAT, TEXT_COMPLETION, CallerGone, Completions
from services.ingress.errors import ApiError
from services.ingress.metrics import IngressMetrics
from shared.api_keys import KeyRecord, make_record, write_keys_file
from shared.config import AuthSettings, IngressSettings
from services.ingress.key_limits import Verdict
from tests.unit.test_request_tracing import Recorded, cluster_with

BODY = {"model": "m", "prompt": "hello there", "max_tokens": 5}


class Store:
    """The Redis key store, as a dict; counts its reads."""

    def __init__(self, *records: KeyRecord) -> None:
        self.records = {record.id: record for record in records}
        self.reads = 0
        self.down = False

    async def get(self, key_id: str) -> KeyRecord | None:
        self.reads += 1
        if self.down:
            raise RedisConnectionError("Redis is down")
        return self.records.get(key_id)


class Limiter:
    def __init__(self, verdict: Verdict = Verdict(True)) -> None:
        self.verdict = verdict
        self.admitted: list[tuple[str, str, int]] = []
        self.settled: list[tuple[str, str, int | None]] = []
        self.renewed: list[dict] = []

    async def admit(self, record: KeyRecord, request_id: str, cost: int, slot_ttl_s: float) -> Verdict:
        self.admitted.append((record.id, request_id, cost))
        return self.verdict

    async def settle(self, key_id: str, request_id: str, tokens: int | None) -> None:
        self.settled.append((key_id, request_id, tokens))

    async def renew(self, running: dict, slot_ttl_s: float) -> None:
        self.renewed.append(running)


class Dispatcher:
    """Remembers what it was asked to run; yields `tokens` tokens and the end, or fails first with `fail`."""

    def __init__(self, tokens: int = 2, fail: BaseException | None = None) -> None:
        self.prepared: list = []
        self._tokens = tokens
        self._fail = fail

    async def run(self, request_id: str, prepared, trace_context=None, on_capped=None) -> AsyncIterator[TokenChunk | StreamEnd]:
        self.prepared.append(prepared)
        if self._fail is not None:
            raise self._fail
        for i in range(self._tokens):
            yield TokenChunk(request_id, i, [5], "a")
        yield StreamEnd(request_id, self._tokens, "length", Usage(len(prepared.prompt_token_ids), self._tokens, 0), Timings(), "w7")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Setup:
    def __init__(self, *records: KeyRecord, required: bool = True, verdict: Verdict = Verdict(True), tokens: int = 2,
                 fail: BaseException | None = None, keys_file: str = "") -> None:
        self.store, self.limiter, self.clock = Store(*records), Limiter(verdict), Clock()
        self.dispatcher, self.recorded = Dispatcher(tokens, fail), Recorded()
        self.metrics = IngressMetrics()
        settings = AuthSettings(required=required, keys_file=keys_file, cache_ttl_s=2.0)
        self.auth = Authenticator(settings, self.store, self.limiter, clock=self.clock)  # type: ignore[arg-type]
        self.completions = Completions(IngressSettings(max_body_bytes=4096), cluster_with("m"), self.dispatcher,  # type: ignore[arg-type]
                                       self.metrics, telemetry=self.recorded.telemetry, auth=self.auth)

    async def ask(self, key: str | None, body: dict = BODY, caller_gone=lambda: False) -> dict:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        operation = CHAT if "messages" in body else TEXT_COMPLETION
        call = await self.completions.start(operation, json.dumps(body).encode(), caller_gone, headers)
        async with call:
            return json.loads(await call.body())

    async def refused(self, key: str | None, body: dict = BODY, headers: dict | None = None) -> ApiError:
        headers = headers if headers is not None else ({} if key is None else {"Authorization": f"Bearer {key}"})
        with pytest.raises(ApiError) as info:
            await self.completions.start(TEXT_COMPLETION, json.dumps(body).encode(), lambda: False, headers)
        return info.value

    async def settled(self) -> list:
        await self.auth.close()
        return self.limiter.settled

    def span_text(self) -> str:
        return " ".join(f"{span.name} {dict(span.attributes or {})} {span.status.description}" for span in self.recorded.finished())


async def test_without_auth_required_nothing_is_asked_or_checked() -> None:
    setup = Setup(required=False)
    reply = await setup.ask("not-a-key")
    assert reply["usage"]["completion_tokens"] == 2
    assert await setup.ask(None)
    assert setup.store.reads == 0 and setup.limiter.admitted == []
    assert [p.tenant for p in setup.dispatcher.prepared] == ["", ""]
    models = json.loads(await setup.completions.models({}))
    assert [m["id"] for m in models["data"]] == ["m"]


@pytest.mark.parametrize("case", ["missing", "malformed", "wrong_secret", "unknown_id", "basic"])
async def test_a_missing_or_bad_key_is_401_and_is_never_echoed(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    record, key = make_record("acme")
    other_record, other_key = make_record("acme")
    setup = Setup(record)
    presented = {"missing": None, "malformed": "kvl_oops_not-a-key-at-all-s3cr3t", "unknown_id": other_key,
                 "wrong_secret": f"kvl_{record.id}_{other_key[17:]}", "basic": None}[case]
    headers = {"Authorization": "Basic c2VjcmV0LXVzZXI6czNjcjN0"} if case == "basic" else None
    # Another test may have configured structlog for a service (a level filter, cached loggers):
    # log through structlog's defaults here, and put that configuration back afterwards.
    configured = structlog.get_config()
    structlog.reset_defaults()
    try:
        with structlog.testing.capture_logs() as logs:
            monkeypatch.setattr(auth_module, "log", structlog.get_logger("kvlane.ingress"))
            error = await setup.refused(presented, headers=headers)
    finally:
        structlog.configure(**configured)
    assert error.status == 401 and error.type == "authentication_error"
    assert error.code == ("missing_api_key" if case in ("missing", "basic") else "invalid_api_key")
    response = error.response()
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    shown = json.dumps(msgspec.to_builtins(error.body())) + json.dumps(logs) + setup.span_text()
    assert any(entry["event"] == "auth_failed" for entry in logs)
    for secret in [presented, (presented or "")[17:], "c2VjcmV0LXVzZXI6czNjcjN0", key, other_key]:
        if secret:
            assert secret not in shown
    assert setup.dispatcher.prepared == [] and setup.limiter.admitted == []
    assert 'kvlane_ingress_tenant_requests_total{status="401",tenant="-"} 1.0' in setup.metrics.exposition().decode()


async def test_a_key_is_checked_before_the_body() -> None:
    setup = Setup(make_record("acme")[0])
    error = await setup.refused(None, body={"model": "m", "prompt": "x", "bogus": 1})
    assert error.status == 401


async def test_a_model_the_key_may_not_use_is_403() -> None:
    record, key = make_record("acme", models=["other"], rpm=10)
    setup = Setup(record)
    error = await setup.refused(key)
    assert (error.status, error.type, error.code, error.param) == (403, "permission_denied_error", "model_not_allowed", "model")
    assert key not in error.message
    assert setup.dispatcher.prepared == [] and setup.limiter.admitted == []
    allowed, allowed_key = make_record("acme", models=["m"])
    setup.store.records[allowed.id] = allowed
    assert (await setup.ask(allowed_key))["usage"]["completion_tokens"] == 2


async def test_priority_is_clamped_to_the_keys_maximum_and_the_tenant_rides_along() -> None:
    record, key = make_record("acme", priority_max=2)
    setup = Setup(record)
    await setup.ask(key, {**BODY, "priority": 7})
    await setup.ask(key, {**BODY, "priority": 1})
    assert [(p.priority, p.tenant) for p in setup.dispatcher.prepared] == [(2, "acme"), (1, "acme")]
    clamped, kept = setup.recorded.finished()
    assert clamped.attributes["kvlane.priority"] == 2 and clamped.attributes["kvlane.priority.requested"] == 7
    assert kept.attributes["kvlane.priority"] == 1 and "kvlane.priority.requested" not in kept.attributes
    assert clamped.attributes["kvlane.tenant"] == "acme" and clamped.attributes["kvlane.api_key.id"] == record.id
    assert key[17:] not in setup.span_text()


async def test_tokens_are_reserved_at_admission_and_corrected_to_what_was_used() -> None:
    record, key = make_record("acme", tpm=1000, max_concurrency=2)
    setup = Setup(record, tokens=3)
    reply = await setup.ask(key, {**BODY, "max_tokens": 40})
    prompt = reply["usage"]["prompt_tokens"]
    ((key_id, request_id, cost),) = setup.limiter.admitted
    assert (key_id, cost) == (record.id, prompt + 40)
    assert await setup.settled() == [(record.id, request_id, prompt + 3)]
    exposition = setup.metrics.exposition().decode()
    assert 'kvlane_ingress_tenant_requests_total{status="200",tenant="acme"} 1.0' in exposition
    assert 'kvlane_ingress_tenant_tokens_total{kind="completion",tenant="acme"} 3.0' in exposition


async def test_a_key_without_limits_costs_no_round_trip() -> None:
    record, key = make_record("acme", models=["m"], priority_max=5)
    setup = Setup(record)
    await setup.ask(key)
    assert setup.limiter.admitted == [] and await setup.settled() == []


@pytest.mark.parametrize(("reason", "code"), [("rpm", "rate_limit_exceeded"), ("tpm", "rate_limit_exceeded"),
                                              ("concurrency", "concurrency_limit_exceeded")])
async def test_a_refused_admission_is_429_with_retry_after(reason: str, code: str) -> None:
    record, key = make_record("acme", rpm=3, tpm=100, max_concurrency=1)
    setup = Setup(record, verdict=Verdict(False, reason, 12.2))
    error = await setup.refused(key)
    assert (error.status, error.type, error.code) == (429, "rate_limit_error", code)
    assert error.response().headers["Retry-After"] == "13"
    assert setup.dispatcher.prepared == [] and await setup.settled() == []


async def test_a_request_larger_than_the_tpm_is_429_without_retry_after() -> None:
    record, key = make_record("acme", tpm=10)
    error = await Setup(record, verdict=Verdict(False, "too_large", None)).refused(key)
    assert (error.status, error.code, error.retry_after_s) == (429, "request_too_large", None)
    assert "Retry-After" not in error.response().headers


async def test_the_admission_is_settled_when_dispatch_fails() -> None:
    record, key = make_record("acme", max_concurrency=1)
    setup = Setup(record, fail=ApiError(503, "no balancer is running", code="balancer_unavailable"))
    error = await setup.refused(key)
    assert error.status == 503
    ((_, request_id, _),) = setup.limiter.admitted
    prompt = len(setup.dispatcher.prepared[0].prompt_token_ids)
    assert await setup.settled() == [(record.id, request_id, prompt)]  # the prompt, no output
    assert setup.auth._running == {}


async def test_the_admission_is_settled_when_the_caller_leaves_mid_stream() -> None:
    record, key = make_record("acme", max_concurrency=1)
    setup = Setup(record, tokens=10)
    gone = iter([False, False, True])  # checked as each frame after the first arrives
    with pytest.raises(CallerGone):
        await setup.ask(key, caller_gone=lambda: next(gone, True))
    ((_, request_id, _),) = setup.limiter.admitted
    prompt = len(setup.dispatcher.prepared[0].prompt_token_ids)
    # Four tokens reached the ingress (the fourth as the caller was found gone) of ten: those count, not max_tokens.
    assert await setup.settled() == [(record.id, request_id, prompt + 4)]
    assert 'status="499",tenant="acme"' in setup.metrics.exposition().decode()


async def test_the_admission_is_settled_once_when_the_handler_is_cancelled() -> None:
    record, key = make_record("acme", max_concurrency=1)
    setup = Setup(record)
    call = await setup.completions.start(TEXT_COMPLETION, json.dumps(BODY).encode(), lambda: False,
                                         {"Authorization": f"Bearer {key}"})
    assert setup.auth._running == {record.id: {call.request_id}}
    await setup.auth._renew()
    assert setup.limiter.renewed == [{record.id: [call.request_id]}]  # slots of running requests are renewed
    await call.aclose(asyncio.CancelledError())
    await call.aclose()
    assert len(await setup.settled()) == 1 and setup.auth._running == {}


async def test_models_need_a_key_and_list_only_what_it_may_use() -> None:
    record, key = make_record("acme", models=["other"])
    setup = Setup(record)
    with pytest.raises(ApiError) as info:
        await setup.completions.models({})
    assert info.value.status == 401
    assert json.loads(await setup.completions.models({"authorization": f"Bearer {key}"}))["data"] == []
    everything, all_key = make_record("acme")
    setup.store.records[everything.id] = everything
    assert [m["id"] for m in json.loads(await setup.completions.models({"Authorization": f"Bearer {all_key}"}))["data"]] == ["m"]


async def test_a_revoked_key_stops_working_within_the_cache_ttl() -> None:
    record, key = make_record("acme")
    setup = Setup(record)
    await setup.ask(key)
    await setup.ask(key)
    assert setup.store.reads == 1  # cached: no round trip per request
    del setup.store.records[record.id]
    setup.clock.now += 1.9
    await setup.ask(key)  # still cached
    setup.clock.now += 0.1  # cache_ttl_s = 2 since it was read
    assert (await setup.refused(key)).status == 401
    # Unknown ids are cached too: a flood of made-up keys costs one read per id per TTL.
    reads = setup.store.reads
    for _ in range(5):
        await setup.refused(key)
    assert setup.store.reads == reads


async def test_an_unreadable_key_store_is_503() -> None:
    record, key = make_record("acme")
    setup = Setup(record)
    setup.store.down = True
    error = await setup.refused(key)
    assert (error.status, error.code, error.retry_after_s) == (503, "auth_unavailable", 1.0)


async def test_keys_from_a_file_are_re_read_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    record, key = make_record("static", models=["m"])
    other, other_key = make_record("static")
    write_keys_file(path, [record])
    setup = Setup(keys_file=str(path))
    await setup.ask(key)
    assert setup.store.reads == 0
    write_keys_file(path, [other])
    setup.clock.now += 2.0
    assert (await setup.refused(key)).status == 401
    await setup.ask(other_key)
    path.write_text("broken [")  # a bad new version: the last good one stays
    setup.clock.now += 2.0
    await setup.ask(other_key)


def test_a_bad_keys_file_stops_the_ingress_at_start(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text("{")
    with pytest.raises(ValueError, match="ingress.auth.keys_file"):
        Authenticator(AuthSettings(required=True, keys_file=str(path)), None, None)
    with pytest.raises(ValueError, match="cannot read"):
        Authenticator(AuthSettings(required=True, keys_file=str(tmp_path / "absent.toml")), None, None)


async def test_a_caller_gone_during_admission_gives_its_slot_back() -> None:
    record, key = make_record("acme", max_concurrency=1)
    setup = Setup(record)
    asked = asyncio.Event()

    async def slow_admit(record: KeyRecord, request_id: str, cost: int, slot_ttl_s: float) -> Verdict:
        setup.limiter.admitted.append((record.id, request_id, cost))
        asked.set()
        await asyncio.Event().wait()  # Redis answers after the caller has gone
        raise AssertionError("unreachable")

    setup.limiter.admit = slow_admit  # type: ignore[method-assign]
    task = asyncio.create_task(setup.completions.start(TEXT_COMPLETION, json.dumps(BODY).encode(), lambda: False,
                                                       {"Authorization": f"Bearer {key}"}))
    await asyncio.wait_for(asked.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ((_, request_id, _),) = setup.limiter.admitted
    assert [(k, r) for k, r, _ in await setup.settled()] == [(record.id, request_id)]
    assert setup.dispatcher.prepared == []


async def test_the_tenant_and_the_clamped_priority_reach_the_route_request() -> None:
    import time

    from contracts.messages import ErrorReply, RouteRequest, SamplingParams
    from services.ingress.dispatch import Dispatcher as RealDispatcher
    from services.ingress.prompts import PreparedRequest

    class Bus:
        sent: list = []

        async def request(self, subject: str, message: object, reply_type: object, timeout: float, context=None) -> ErrorReply:
            self.sent.append(message)
            return ErrorReply("no_capacity", "full", 503)

    record, _ = make_record("acme", priority_max=1)
    asked = PreparedRequest("m", [1, 2, 3], [], SamplingParams(max_tokens=4), False, False, priority=5)
    bus = Bus()
    dispatcher = RealDispatcher(bus, None, IngressSettings(), lambda worker_id: 0.0, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ApiError):
        await dispatcher._route("r1", Authenticator.apply(record, asked), time.time() + 10, [], 0)
    (route,) = bus.sent
    assert isinstance(route, RouteRequest) and (route.tenant, route.priority) == ("acme", 1)
