"""The private parts of nats-py, aiohttp and redis-py that kvlane relies on, pinned.

Each test checks one internal in the shape kvlane uses it (exercised for real where that is cheap: the nats-py
ones against a real nats-server) and fails naming the installed version, what changed, and the kvlane code to
revisit. vLLM's are in tests/vllm/test_vllm_internals.py. msgspec, opentelemetry and prometheus_client are used
through their public API only.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import nats
import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_runner import BaseRunner
from aiohttp.web_server import Server
from nats import micro
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import Endpoint
from redis.asyncio.cluster import ClusterPipeline, RedisCluster

from launch.launcher import Launcher, free_port
from services.ingress.errors import ApiError
from services.ingress.http_guard import GuardedHandler, GuardedRunner, GuardedServer, HttpGuard
from services.ingress.nats_api import _account
from shared.bus import _AtOnce
from shared.config import IngressSettings
from shared.state import BoundedRedisCluster, _BoundedPipeline
from tests.internals import changed, parameters, reads, subclass_mismatch
from tests.waiting import until

AT_ONCE = ("shared/bus.py's _AtOnce (the reply future Bus hands to `NatsClient.subscribe(future=...)` for its reply "
           "inbox, at_once and concurrent subscriptions)")
SERVER_INFO = "shared/model_store.py's publish_tokenizer (reads `nc._server_info['jetstream']`)"
MICRO_STATS = ("services/ingress/nats_api.py's _account and NatsApi._endpoint (add a request's own time and outcome to "
               "its endpoint's $SRV.STATS)")
MICRO_REQUEST = "services/ingress/nats_api.py's NatsApi._complete and _reply_error (read `request._msg.reply`)"
HEAD_TIMER = ("services/ingress/http_guard.py's GuardedHandler (head timer and lingering: `_request_count`, "
              "`_request_in_progress`, `_messages`, `_lingering_time`, `_loop`)")
GUARDED_RUNNER = ("services/ingress/http_guard.py's GuardedRunner._make_server and GuardedServer (rebuild aiohttp's "
                  "server from `_loop`, `_kwargs` and its handler settings)")
BOUNDED_PIPELINE = "shared/state.py's BoundedRedisCluster.pipeline and _BoundedPipeline"


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One nats-server with JetStream for the module's tests."""
    directory = tmp_path_factory.mktemp("nats")
    launcher = Launcher(directory)
    port = free_port()
    launcher.start_nats(port, extra_args=["-js", "-sd", str(directory / "jetstream")])
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        launcher.stop_all()


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await nats.connect(nats_url, max_reconnect_attempts=0)
    try:
        yield client
    finally:
        await client.close()


# --- nats-py: the reply future ----------------------------------------------------------------------------------


class _WatchedAtOnce(_AtOnce):
    """kvlane's fake future, noting whatever else nats-py asks of it."""

    def __init__(self, deliver: Callable[[Msg], None], asked: list[str]) -> None:
        super().__init__(deliver)
        self.asked = asked

    def __getattr__(self, name: str) -> Any:
        self.asked.append(name)
        raise AttributeError(name)


def test_nats_subscribe_still_takes_a_reply_future() -> None:
    assert "future" in parameters(NatsClient.subscribe), changed(
        "nats", "`Client.subscribe` no longer takes `future=`", AT_ONCE,
        "subscribe with `cb=` (one task per subscription) or find nats-py's new way to be handed messages in its read loop")
    future = _AtOnce(lambda msg: None)
    subscription = Subscription(None, id=1, subject="pinned", future=future)  # type: ignore[arg-type]
    assert getattr(subscription, "_future", None) is future, changed(
        "nats", "`Subscription` no longer keeps its `future=` as `_future`, where its read loop delivers", AT_ONCE)


async def test_nats_hands_every_message_of_a_future_subscription_to_set_result(nc: NatsClient) -> None:
    """nats-py resolves a request's future with the first message; kvlane's takes every one, and only
    `cancelled()` and `set_result()` may be asked of it."""
    asked: list[str] = []
    received: list[bytes] = []
    all_arrived = asyncio.Event()

    def deliver(msg: Msg) -> None:
        received.append(msg.data)
        if len(received) == 3:
            all_arrived.set()

    await nc.subscribe("pinned.at_once", queue="pinned", future=_WatchedAtOnce(deliver, asked))
    for n in range(3):
        await nc.publish("pinned.at_once", str(n).encode())
    await nc.flush()
    try:
        await asyncio.wait_for(all_arrived.wait(), timeout=10)
    except TimeoutError:
        pass
    assert received == [b"0", b"1", b"2"] and not asked, changed(
        "nats", f"a subscription given `future=` no longer hands each message to `future.set_result` (received "
                f"{received} of [b'0', b'1', b'2']; nats-py also asked the future for {asked or 'nothing else'})",
        AT_ONCE, "make _AtOnce answer what nats-py now asks of a future, or go back to `cb=` subscriptions")
    assert nc.is_connected, changed("nats", "delivering to _AtOnce broke the connection's read loop", AT_ONCE)


# --- nats-py: the server's INFO ---------------------------------------------------------------------------------


async def test_nats_client_keeps_the_server_info(nc: NatsClient) -> None:
    info = getattr(nc, "_server_info", None)
    assert isinstance(info, dict) and info.get("jetstream") is True, changed(
        "nats", f"`Client._server_info` no longer holds the server's INFO (found {info!r} connected to a JetStream "
                "server), so every tokenizer publish would be refused as 'JetStream is not enabled'",
        SERVER_INFO, "read whether the server runs JetStream from nats-py's new place for INFO")


# --- nats.micro: endpoint statistics ----------------------------------------------------------------------------


async def test_nats_micro_reports_the_endpoint_fields_kvlane_adds_to(nc: NatsClient) -> None:
    service = await micro.add_service(nc, name="pinned", version="0.0.1")
    requests: list[micro.Request] = []

    async def handler(request: micro.Request) -> None:
        requests.append(request)
        await request.respond(b"ok")

    try:
        await service.add_endpoint(name="work", subject="pinned.work", handler=handler)
        request_msg = await nc.request("pinned.work", b"x", timeout=10)
        assert request_msg.data == b"ok"

        endpoints = getattr(service, "_endpoints", None)
        assert isinstance(endpoints, list) and [getattr(e, "_name", None) for e in endpoints] == ["work"], changed(
            "nats", f"`nats.micro.Service._endpoints` no longer lists its endpoints with their `_name` (found {endpoints!r})",
            MICRO_STATS)
        endpoint = endpoints[0]
        assert isinstance(endpoint, Endpoint)
        fields = ("_num_requests", "_num_errors", "_processing_time", "_average_processing_time", "_last_error")
        missing = [field for field in fields if not hasattr(endpoint, field)]
        assert not missing, changed("nats", f"`nats.micro.Endpoint` lost its statistics fields {missing}", MICRO_STATS)
        assert getattr(requests[0], "_msg", None) is not None and requests[0]._msg.reply, changed(
            "nats", "`nats.micro.Request` no longer keeps its message as `_msg` (with its `reply` subject)", MICRO_REQUEST,
            "find the request's reply subject another way")

        before = json.loads((await nc.request("$SRV.STATS.pinned", b"", timeout=10)).data)["endpoints"][0]
        _account(endpoint, 7_000, ApiError(503, "busy"))
        after = json.loads((await nc.request("$SRV.STATS.pinned", b"", timeout=10)).data)["endpoints"][0]
        assert (after["processing_time"] - before["processing_time"], after["num_errors"] - before["num_errors"],
                after["last_error"], after["average_processing_time"]) == (
            7_000, 1, "503:busy", int(after["processing_time"] / after["num_requests"])), changed(
            "nats", f"$SRV.STATS no longer reports the endpoint fields kvlane adds to (before {before}, after {after})",
            MICRO_STATS)
    finally:
        await service.stop()


# --- aiohttp: the connection's protocol and the runner's server --------------------------------------------------


def test_aiohttp_request_handler_keeps_the_fields_the_head_timer_reads() -> None:
    slots = {name for cls in RequestHandler.__mro__ for name in getattr(cls, "__slots__", ())}
    missing = {"_request_count", "_request_in_progress", "_messages", "_lingering_time", "_loop", "transport"} - slots
    assert not missing, changed("aiohttp", f"`aiohttp.web_protocol.RequestHandler` lost the fields {sorted(missing)}",
                                HEAD_TIMER)
    assert not reads(RequestHandler.data_received, "_request_count", "_messages"), changed(
        "aiohttp", "`RequestHandler.data_received` no longer counts parsed heads in `_request_count` and queues them "
                   "in `_messages`", HEAD_TIMER, "how GuardedHandler.data_received tells a whole head arrived")
    assert not reads(RequestHandler.start, "_lingering_time"), changed(
        "aiohttp", "`RequestHandler.start` no longer reads `_lingering_time` before it reads on past a response",
        HEAD_TIMER, "GuardedHandler.stop_lingering")
    assert {"request", "status", "exc", "message"} <= parameters(RequestHandler.handle_error), changed(
        "aiohttp", "`RequestHandler.handle_error` takes other parameters", HEAD_TIMER, "GuardedHandler.handle_error")


def test_aiohttp_runner_still_builds_its_server_in_make_server() -> None:
    assert not reads(BaseRunner.setup, "_make_server"), changed(
        "aiohttp", "`BaseRunner.setup` no longer builds its server by `await self._make_server()`", GUARDED_RUNNER)
    assert {"handler", "request_factory", "handler_cancellation", "loop", "kwargs"} <= parameters(Server.__init__), changed(
        "aiohttp", "`web.Server.__init__` takes other parameters", GUARDED_RUNNER)


async def test_aiohttp_serves_through_the_guarded_runner_with_the_fields_kvlane_reads() -> None:
    in_progress: list[bool] = []

    async def hello(request: web.Request) -> web.Response:
        in_progress.append(getattr(request.protocol, "_request_in_progress", None))
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    settings = IngressSettings()
    runner = HttpGuard(settings, ()).runner(app)
    try:
        await runner.setup()
    except AttributeError as exc:
        pytest.fail(changed("aiohttp", f"the server `AppRunner._make_server` makes lost an attribute: {exc}", GUARDED_RUNNER))
    try:
        server = runner.server
        assert isinstance(server, GuardedServer) and server._kwargs.get("max_line_size") == settings.max_line_size, changed(
            "aiohttp", "`AppRunner.setup` no longer serves with the server `_make_server` returned, with its `_kwargs`",
            GUARDED_RUNNER)
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: pinned\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            assert head.startswith(b"HTTP/1.1 200"), head
            handlers = server.connections
            assert len(handlers) == 1 and isinstance(handlers[0], GuardedHandler), changed(
                "aiohttp", f"a connection is no longer served by the handler `Server.__call__` makes ({handlers})", GUARDED_RUNNER)
            handler = handlers[0]
            assert in_progress == [True], changed(
                "aiohttp", f"`RequestHandler._request_in_progress` is {in_progress} while a request is handled", HEAD_TIMER,
                "GuardedHandler.data_received and _head_timed_out (a head timer must not fire under a running request)")
            await until(lambda: not handler._request_in_progress, 10, "the request to end")
            assert (handler._request_count, len(handler._messages), type(handler._lingering_time)) == (1, 0, float) and \
                isinstance(handler._messages, deque) and handler._loop is asyncio.get_running_loop(), changed(
                "aiohttp", f"after one request, `_request_count` is {handler._request_count}, `_messages` "
                           f"{handler._messages!r}, `_lingering_time` {handler._lingering_time!r}", HEAD_TIMER)
        finally:
            writer.close()
            await writer.wait_closed()
    finally:
        await runner.cleanup()


# --- redis-py: the cluster pipeline -------------------------------------------------------------------------------


async def test_redis_cluster_pipeline_is_built_as_bounded_cluster_builds_it() -> None:
    assert {"transaction", "shard_hint"} <= parameters(RedisCluster.pipeline), changed(
        "redis", "`RedisCluster.pipeline` takes other parameters", BOUNDED_PIPELINE)
    assert {"raise_on_error", "allow_redirections"} <= parameters(ClusterPipeline.execute), changed(
        "redis", "`ClusterPipeline.execute` takes other parameters", BOUNDED_PIPELINE, "_BoundedPipeline.execute passes them on")
    client = BoundedRedisCluster.from_url("redis://127.0.0.1:1", max_in_flight=1)  # connects on first use only
    try:
        pipeline = client.pipeline(transaction=False)
        assert isinstance(pipeline, _BoundedPipeline) and getattr(pipeline, "cluster_client", None) is client, changed(
            "redis", "`ClusterPipeline(client, transaction)` no longer keeps its client as `cluster_client`", BOUNDED_PIPELINE)
    finally:
        await client.aclose()


# --- kvlane's subclasses --------------------------------------------------------------------------------------


# (kvlane's subclass, the dependency, what it overrides on purpose, where it is)
SUBCLASSES = [
    (GuardedHandler, "aiohttp", {"connection_made", "connection_lost", "data_received", "handle_error"}, HEAD_TIMER),
    (GuardedServer, "aiohttp", {"connection_made", "connection_lost"}, GUARDED_RUNNER),
    (GuardedRunner, "aiohttp", {"_make_server"}, GUARDED_RUNNER),
    (BoundedRedisCluster, "redis", {"execute_command", "pipeline"}, BOUNDED_PIPELINE),
    (_BoundedPipeline, "redis", {"execute"}, BOUNDED_PIPELINE),
]


@pytest.mark.parametrize(("cls", "dependency", "overrides", "where"), SUBCLASSES, ids=[case[0].__name__ for case in SUBCLASSES])
def test_kvlanes_subclasses_override_what_they_mean_to_and_shadow_nothing(
    cls: type, dependency: str, overrides: set[str], where: str,
) -> None:
    mismatch = subclass_mismatch(cls, dependency, overrides, where)
    assert mismatch is None, mismatch
