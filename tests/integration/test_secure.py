"""A secured fleet (`kvlane up --secure`): credentials per process, least-privilege permissions.

Real nats-server and redis-server, started by `Security` with the users and
permissions of launch/permissions.py. The fleet serves everything it serves
unsecured (HTTP, the NATS API, queueing, `kvlane status`, health probes, the
autoscaler, a worker added later, prefill/decode hand-offs) while nats-server
logs no permission violation of a kvlane service and Redis refuses none of
their commands; and what a service has no business doing is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import msgspec
import nats
import nats.errors
import pytest
import redis
import redis.asyncio as aioredis

from contracts import subjects
from contracts.autoscaler import ScalingDecision
from contracts.balancer import BalancerStatusRequest
from kvlane.client import KvlaneClient
from launch.fleet import Fleet, start_fleet, with_overrides
from launch.launcher import Launcher, free_port, wait_ready, wait_services_ready
from launch.secure import Security
from kvlane.status import fetch_statuses
from shared.config import KvlaneConfig, NatsSettings
from shared.credentials import nats_options, redis_url_and_options
from shared.state import ClusterState, connect_redis
from tests.integration.conftest import MODEL, fleet_config, stop_and_check

pytestmark = pytest.mark.integration

# How nats-server 2.15 logs a refused publish or subscription: `"v2.16.0:python3:<connection name>" -
# "$G/user:<user>" - Publish Violation - Subject "<subject>"` (older servers: "Permissions Violation").
VIOLATION = re.compile(r"(Publish|Subscription) Violation - Subject|Permissions Violation")
# A kvlane service's connection is named kvlane-<service>-<id>.
SERVICE_CONNECTION = re.compile(r'"v[^"]*:kvlane-')
# What a refused service would log: nats-py's error callback, Redis's refusals (redis-py drops the NOPERM code:
# "this user has no permissions to run the 'x' command", "... to access one of the keys used as arguments").
REFUSALS = re.compile(r"(?i)permissions violation|authorization violation|no permissions to|NOPERM|NOAUTH|WRONGPASS|"
                      r"invalid username-password|authentication required|"
                      # A reload for a new process's user must not cut the others' connections.
                      r"connection lost|connection closed by server|nats_disconnected")


def secure_launch(log_dir: Path, workers: int = 2, tune: Callable[[KvlaneConfig], KvlaneConfig] | None = None,
                  prefill_workers: int = 0, decode_workers: int = 0, **sim: object) -> Fleet:
    """A fleet whose NATS and Redis `Security` starts (on free ports) with a user per process."""
    config = fleet_config(free_port(), free_port(), **sim)
    config = with_overrides(config, health={"probe_interval_s": 0.5}, autoscaler={"interval_s": 0.5})
    return start_fleet(Launcher(log_dir), tune(config) if tune else config, workers, prefill_workers=prefill_workers,
                       decode_workers=decode_workers, security=Security(log_dir / "secure"))


def nats_log(fleet: Fleet) -> str:
    return fleet.servers[0].log_path.read_text(errors="replace")


def service_violations(fleet: Fleet) -> list[str]:
    """Permission violations of kvlane's own connections in nats-server's log."""
    return [line for line in nats_log(fleet).splitlines() if VIOLATION.search(line) and SERVICE_CONNECTION.search(line)]


def refused_in_service_logs(fleet: Fleet) -> list[str]:
    return [f"{p.name}: {line}" for p in fleet.launcher.log_dir.glob("*.log") if p.name not in ("nats-server.log", "redis-server.log")
            for line in p.read_text(errors="replace").splitlines() if REFUSALS.search(line)]


def assert_nothing_refused(fleet: Fleet) -> None:
    assert not service_violations(fleet), "\n".join(service_violations(fleet))
    refused = refused_in_service_logs(fleet)
    assert not refused, "\n".join(refused[:20])


def as_role(fleet: Fleet, role: str, instance_id: str = "") -> KvlaneConfig:
    assert fleet.security is not None
    return fleet.security.settings_for(fleet.config, role, instance_id)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two aggregated workers with one slot each (so requests queue), 5 ms per token."""

    def tune(config: KvlaneConfig) -> KvlaneConfig:
        return with_overrides(config, **{"balancer.slots": {"max_per_chain": 1}})

    fleet = secure_launch(tmp_path_factory.mktemp("secure"), tune=tune, speed=0.5)
    yield fleet
    stop_and_check(fleet)


async def complete(session: aiohttp.ClientSession, fleet: Fleet, prompt: str, max_tokens: int = 12,
                   stream: bool = False) -> tuple[int, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    async with session.post(f"{fleet.base_url}/v1/completions", json=body) as response:
        return response.status, await response.text()


# --- the fleet serves ------------------------------------------------------------------------------------


async def test_secured_fleet_serves_requests_and_queues_them(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        replies = await asyncio.gather(*(complete(session, fleet, f"prompt {i}", 40) for i in range(6)),
                                       complete(session, fleet, "streamed", 8, stream=True))
        assert all(status == 200 for status, _ in replies), replies
        assert replies[-1][1].rstrip().endswith("data: [DONE]")
        async with session.get(f"{fleet.base_url}/metrics") as response:
            exposition = await response.text()
    # Six requests on two one-slot workers: some waited in the balancer's queue (and were answered from it).
    queued_s = float(re.search(r'^vllm:request_queue_time_seconds_sum\{model_name="kvlane-sim"\} (\S+)$', exposition, re.M)[1])
    assert queued_s > 0


async def test_the_operator_uses_the_nats_api_discovery_and_status(fleet: Fleet) -> None:
    operator = as_role(fleet, "operator").nats
    async with await KvlaneClient.connect(**nats_options(operator)) as client:
        reply = await client.completions({"model": MODEL, "prompt": "over nats", "max_tokens": 5})
        assert reply["usage"]["completion_tokens"] == 5
        chunks = [chunk async for chunk in client.stream_completions({"model": MODEL, "prompt": "streamed", "max_tokens": 4})]
        assert chunks
        assert (await client.models())["data"][0]["id"] == MODEL
    nc = await nats.connect(**nats_options(operator))
    try:
        ping = await nc.request(f"$SRV.PING.{subjects.API_SERVICE}", b"", timeout=5)
        assert json.loads(ping.data)["name"] == subjects.API_SERVICE
    finally:
        await nc.close()
    [status] = await fetch_statuses(operator, MODEL, 5.0)
    assert {chain.worker_id for chain in status.chains} == {"w0", "w1"}


def test_a_worker_started_later_gets_its_own_user(fleet: Fleet) -> None:
    reloads = nats_log(fleet).count("Reloaded server configuration")
    fleet.add_worker("w2")
    wait_ready(fleet.base_url, 60, fleet.services(), min_workers=3)
    assert nats_log(fleet).count("Reloaded server configuration") > reloads
    assert "worker-w2" in fleet.security.nats_config.read_text()


async def test_the_autoscaler_and_health_prober_work_secured(fleet: Fleet) -> None:
    wait_services_ready([fleet.add_autoscaler()])
    url, options = redis_url_and_options(as_role(fleet, "operator").redis)
    operator = aioredis.Redis.from_url(url, **options)
    try:
        deadline = time.monotonic() + 20
        while (raw := await operator.get(subjects.AUTOSCALER_DECISION_KEY)) is None:
            assert time.monotonic() < deadline, "the autoscaler stored no decision"
            await asyncio.sleep(0.1)
        assert msgspec.json.decode(raw, type=ScalingDecision).pools
    finally:
        await operator.aclose()
    # The prober stored its verdicts under the keys its user may write.
    prober = connect_redis(as_role(fleet, "health-prober", "h0").redis)
    try:
        deadline = time.monotonic() + 20
        while await prober.get(subjects.health_key("w0")) is None:
            assert time.monotonic() < deadline, "no health verdict stored"
            await asyncio.sleep(0.1)
    finally:
        await prober.aclose()


# --- what is refused --------------------------------------------------------------------------------------


async def test_nats_refuses_a_client_without_credentials_or_with_wrong_ones(fleet: Fleet) -> None:
    for credentials in ({}, {"user": "worker-w0", "password": "wrong"}):
        with pytest.raises(nats.errors.Error, match="[Aa]uthorization"):
            await nats.connect(fleet.config.nats.url, allow_reconnect=False, connect_timeout=5, **credentials)


async def test_redis_refuses_a_client_without_credentials_or_with_wrong_ones(fleet: Fleet) -> None:
    port = int(fleet.config.redis.url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"GET kvlane:v1:nodes\r\n")
        assert raw.recv(200).startswith(b"-NOAUTH")
    anonymous = aioredis.Redis.from_url(fleet.config.redis.url)  # redis-py starts with HELLO, refused as well
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await anonymous.get(subjects.NODE_SET_KEY)
    finally:
        await anonymous.aclose()
    wrong = aioredis.Redis.from_url(fleet.config.redis.url, username="worker-w0", password="wrong")
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            await wrong.ping()
    finally:
        await wrong.aclose()


async def test_worker_credentials_cannot_route_or_take_another_workers_requests(fleet: Fleet) -> None:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    w0 = as_role(fleet, "worker", "w0").nats
    nc = await nats.connect(**nats_options(w0), name="attacker", error_cb=on_error, allow_reconnect=False)
    try:
        # A route decision published by a worker reaches no balancer: the server refuses it.
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(subjects.ROUTE, msgspec.msgpack.encode(BalancerStatusRequest()), timeout=1.0)
        await nc.publish(subjects.worker_inbox("w1"), b"abort")
        await nc.subscribe(subjects.worker_inbox("w1"))
        await nc.subscribe("_INBOX.>")
        await nc.flush()
        deadline = time.monotonic() + 10
        while len(errors) < 4:
            assert time.monotonic() < deadline, errors
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    # nats-py reports them in lower case.
    errors = [error.lower() for error in errors]
    assert any(f'publish to "{subjects.ROUTE}"' in e for e in errors), errors
    assert any(f'publish to "{subjects.worker_inbox("w1")}"' in e for e in errors), errors
    assert any(f'subscription to "{subjects.worker_inbox("w1")}"' in e for e in errors), errors
    assert any('subscription to "_inbox.>"' in e for e in errors), errors
    assert any(':attacker"' in line and f'Publish Violation - Subject "{subjects.ROUTE}"' in line
               for line in nats_log(fleet).splitlines()), nats_log(fleet)[-3000:]


async def test_worker_credentials_cannot_touch_the_ledger_or_another_node_in_redis(fleet: Fleet) -> None:
    client = connect_redis(as_role(fleet, "worker", "w0").redis)
    try:
        for command in (("SET", f"{subjects.REDIS_PREFIX}:cache:lease:x", "1"), ("SET", subjects.node_key("w1"), "x"),
                        ("GET", subjects.AUTOSCALER_DECISION_KEY), ("FLUSHALL",), ("KEYS", "*"), ("CONFIG", "GET", "*")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                await client.execute_command(*command)
        # What it needs, it may: the node set (and its own node key, which the worker itself keeps writing).
        assert await client.execute_command("SADD", subjects.NODE_SET_KEY, "w0") == 0
    finally:
        await client.aclose()


def test_no_kvlane_service_was_refused_anything(fleet: Fleet) -> None:
    """Everything above ran with no permission violation of a service: the table covers what the code does."""
    assert "Reloaded server configuration" in nats_log(fleet)  # the log is the server's, and it is read
    assert_nothing_refused(fleet)


# --- prefill/decode -------------------------------------------------------------------------------------------


def test_disaggregated_secured_fleet_hands_off_kv(tmp_path: Path) -> None:
    def tune(config: KvlaneConfig) -> KvlaneConfig:
        return with_overrides(config, **{"balancer.disaggregation": {"min_remote_prefill_tokens": 64}})

    fleet = secure_launch(tmp_path, workers=0, prefill_workers=1, decode_workers=1, tune=tune)
    try:
        body = json.dumps({"model": MODEL, "prompt": "hello world " * 80, "max_tokens": 8}).encode()
        request = urllib.request.Request(f"{fleet.base_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 8

        async def pulls() -> int:
            client = connect_redis(as_role(fleet, "ingress", "i0").redis)
            try:
                deadline = time.monotonic() + 10
                while True:
                    live = {h.heartbeat.registration.worker_id: h.heartbeat.stats for h in await ClusterState(client, 10).live_heartbeats()}
                    if live["d0"].kv_pulls or time.monotonic() > deadline:
                        return live["d0"].kv_pulls
                    await asyncio.sleep(0.1)
            finally:
                await client.aclose()

        # The decode worker pulled the prompt's KV from the prefill worker (over their hand-off grants).
        assert asyncio.run(pulls()) >= 1
        assert_nothing_refused(fleet)
    finally:
        stop_and_check(fleet)


# --- kvlane up --secure --tls, as a user runs it ---------------------------------------------------------------


def test_kvlane_up_secure_tls_serves_and_stops(tmp_path: Path) -> None:
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    config = tmp_path / "kvlane.toml"
    config.write_text(
        f'[nats]\nurl = "nats://127.0.0.1:{nats_port}"\n\n[redis]\nurl = "redis://127.0.0.1:{redis_port}/0"\n\n'
        '[cluster]\nheartbeat_interval_s = 0.25\nheartbeat_ttl_s = 1.0\nresync_interval_s = 0.5\n'
    )
    log_dir = tmp_path / "logs"
    kvlane = str(Path(sys.executable).parent / "kvlane")
    up = subprocess.Popen(
        [kvlane, "up", "--secure", "--tls", "--config", str(config), "--port", str(port), "--workers", "1",
         "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "300"},
    )
    seen: list[str] = []
    try:
        for line in up.stdout:  # ends if kvlane up exits
            seen.append(line)
            if "ready" in line and "base URL" in line:
                break
        assert up.poll() is None, "".join(seen)
        assert any("secured:" in line and str(log_dir / "secure") in line for line in seen), "".join(seen)
        secure = log_dir / "secure"
        for name in ("nats.conf", "users.acl", "redis.conf", "operator.toml", "tls/server-key.pem"):
            assert (secure / name).stat().st_mode & 0o077 == 0, name
        body = json.dumps({"model": MODEL, "prompt": "secured", "max_tokens": 5}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert json.loads(response.read())["usage"]["completion_tokens"] == 5
        status = subprocess.run([kvlane, "status", "--config", str(secure / "operator.toml")], capture_output=True, text=True,
                                timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert status.returncode == 0 and "w0" in status.stdout, status.stdout + status.stderr
        # TLS only: a client that does not trust the fleet's CA is refused, and Redis speaks no clear text.
        assert "TLS required for client connections" in (log_dir / "nats-server.log").read_text()
        assert _nats_refused_without_the_ca(nats_port)
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis.from_url(f"redis://127.0.0.1:{redis_port}/0", socket_timeout=5).ping()
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, "".join(seen) + up.stdout.read()
        assert not VIOLATION.search((log_dir / "nats-server.log").read_text())
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def _nats_refused_without_the_ca(port: int) -> bool:
    async def attempt() -> bool:
        try:
            nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False, connect_timeout=3)
        except Exception:
            return True
        await nc.close()
        return False

    return asyncio.run(attempt())


# --- NKeys and mutual TLS against the servers themselves ------------------------------------------------------


def test_nkey_user_over_mutual_tls_gets_its_permissions(tmp_path: Path) -> None:
    """A worker user identified by an NKey seed file, over TLS where nats-server verifies the client certificate."""
    nkeys = pytest.importorskip("nkeys")
    from launch.certs import make_certs
    from launch import permissions

    certs = make_certs(tmp_path / "tls")
    pair = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    seed_file = tmp_path / "w0.nk"
    seed_file.write_bytes(pair.seed)
    g = permissions.grant(permissions.ROLES["worker"], "worker-w0", "w0")
    conf = tmp_path / "nats.conf"
    conf.write_text(permissions.nats_authorization([permissions.NatsUser(g, nkey=pair.public_key.decode())])
                    + f'tls {{cert_file: "{certs.cert}", key_file: "{certs.key}", ca_file: "{certs.ca}", verify: true}}\n')
    launcher, port = Launcher(tmp_path / "logs"), free_port()
    server = launcher.start_nats(port, config_file=conf)
    settings = NatsSettings(url=f"nats://127.0.0.1:{port}", nkeys_seed_file=str(seed_file), inbox_prefix=g.inbox_prefix,
                            tls_ca=str(certs.ca), tls_cert=str(certs.client_cert), tls_key=str(certs.client_key))

    async def scenario() -> list[str]:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        # Without a client certificate the handshake fails; without the seed, authorization does.
        for missing in ({"tls_cert": "", "tls_key": ""}, {"nkeys_seed_file": ""}):
            with pytest.raises(Exception):  # noqa: B017 - an SSL error or nats' authorization error
                await nats.connect(**nats_options(msgspec.structs.replace(settings, **missing)), allow_reconnect=False,
                                   connect_timeout=3)
        nc = await nats.connect(**nats_options(settings), error_cb=on_error, allow_reconnect=False)
        try:
            inbox = await nc.subscribe(subjects.worker_inbox("w0"))
            await nc.publish(subjects.heartbeat("w0"), b"beat")
            await nc.publish(subjects.ROUTE, b"nope")
            await nc.flush()
            deadline = time.monotonic() + 10
            while not errors:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            await inbox.unsubscribe()
        finally:
            await nc.close()
        return errors

    try:
        errors = asyncio.run(scenario())
        assert len(errors) == 1 and f'publish to "{subjects.ROUTE}"' in errors[0].lower(), errors
    finally:
        launcher.stop_all()
    assert server.popen.returncode is not None


def test_redis_over_tls_with_acl_users(tmp_path: Path) -> None:
    """Redis started as `kvlane up --secure --tls` starts it: TLS only, ACL users, the default user off."""
    security = Security(tmp_path / "secure", tls=True)
    launcher, port = Launcher(tmp_path / "logs"), free_port()
    config = fleet_config(free_port(), port)
    try:
        security._written = set()
        security._write()
        launcher.start_redis(port, config_file=security.redis_config, tls=True)
        security.redis_managed = True
        security._redis_url = f"rediss://127.0.0.1:{port}/0"
        worker = security.settings_for(with_overrides(config, redis={"url": security._redis_url, "tls_ca": str(security.certs.ca)}),
                                       "worker", "w0")
        url, options = redis_url_and_options(worker.redis)
        client = redis.Redis.from_url(url, **options)
        try:
            assert client.sadd(subjects.NODE_SET_KEY, "w0") == 1
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.set(subjects.node_key("w1"), "x")
        finally:
            client.close()
        # The account was added after Redis started: `ACL SETUSER` made it known.
        anonymous = redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0", ssl_ca_certs=str(security.certs.ca))
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.get(subjects.NODE_SET_KEY)
        anonymous.close()
        untrusting = redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0", socket_timeout=5)
        with pytest.raises(redis.exceptions.ConnectionError):
            untrusting.ping()
        # A client certificate, where the server asks for one (here it may), goes with the settings' tls_cert.
        certs = security.certs
        with_cert = msgspec.structs.replace(worker.redis, tls_cert=str(certs.client_cert), tls_key=str(certs.client_key))
        url, options = redis_url_and_options(with_cert)
        assert options["ssl_certfile"] == str(certs.client_cert)
        client = redis.Redis.from_url(url, **options)
        assert client.ping()
        client.close()
    finally:
        security.close()
        launcher.stop_all()
