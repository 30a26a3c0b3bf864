"""API keys and tenants end to end: a sim fleet with `ingress.auth.required`, over HTTP and NATS.

Keys come from `kvlane keys create` (Redis) and from a keys file. Limits are
checked against the fleet's one real Redis, by one ingress and by two
(`test_limits_hold_across_two_ingress_replicas`). Nothing here sleeps for a
fixed time: what takes time (a revocation, a slot freed) is polled with a
deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import aiohttp
import nats
import pytest

from contracts import subjects
from kvlane.cli import build_parser
from launch.fleet import Fleet, with_overrides
from launch.launcher import Process, free_port, wait_services_ready
from shared.api_keys import make_record, write_keys_file
from shared.config import to_env
from tests.integration.conftest import MODEL, launch, stop_and_check
from tests.waiting import wait_for
from tests.integration.test_nats_api import run as nats_run

pytestmark = pytest.mark.integration

CACHE_TTL_S = 0.5
ERROR_CODE = "Nats-Service-Error-Code"
SHORT = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4, "ignore_eos": True}
# Long enough (4000 tokens at half speed: ~20 s) to hold a concurrency slot while a test looks.
LONG = {"model": MODEL, "prompt": "A long story", "max_tokens": 4000, "ignore_eos": True, "stream": True}


class Keys:
    """The static key of the keys file, and `kvlane keys` run against the fleet's Redis."""

    def __init__(self, fleet: Fleet, static_key: str) -> None:
        self.fleet = fleet
        self.static = static_key

    def cli(self, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        args = build_parser().parse_args(["keys", *argv[:1], "--redis-url", self.fleet.config.redis.url, *argv[1:]])
        from rich.console import Console

        code = args.handler(args, Console(width=200))
        out, err = capsys.readouterr()
        return code, out, err

    def create(self, capsys: pytest.CaptureFixture[str], *flags: str, tenant: str = "acme") -> str:
        code, out, err = self.cli(capsys, "create", "--tenant", tenant, *flags)
        assert code == 0, err
        return out.strip()


@pytest.fixture(scope="module")
def fleet_and_static(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    directory = tmp_path_factory.mktemp("api-keys")
    record, key = make_record("static-tenant", models=[MODEL])
    keys_file = directory / "keys.json"
    write_keys_file(keys_file, [record])
    auth = {"required": True, "keys_file": str(keys_file), "cache_ttl_s": CACHE_TTL_S}
    fleet = launch(directory, workers=1, speed=0.5, tune=lambda c: with_overrides(c, ingress={"auth": auth}))
    yield fleet, key
    stop_and_check(fleet)


@pytest.fixture
def keys(fleet_and_static: tuple[Fleet, str]) -> Keys:
    return Keys(*fleet_and_static)


@pytest.fixture
def fleet(fleet_and_static: tuple[Fleet, str]) -> Fleet:
    return fleet_and_static[0]


def post(base_url: str, body: dict, key: str | None, path: str = "/v1/completions") -> tuple[int, dict[str, str], dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{base_url}{path}", data=json.dumps(body).encode() if body else None, headers=headers,
                                     method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


# --- who may ask ---------------------------------------------------------------------------


def test_http_needs_a_valid_key_and_never_echoes_a_bad_one(fleet: Fleet, keys: Keys, capsys) -> None:
    key = keys.create(capsys)
    status, headers, body = post(fleet.base_url, SHORT, None)
    assert status == 401 and body["error"]["type"] == "authentication_error" and body["error"]["code"] == "missing_api_key"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    bad = key[:-6] + "XXXXXX"  # the right id, a wrong secret
    status, _, body = post(fleet.base_url, SHORT, bad)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert bad not in json.dumps(body) and bad[17:] not in json.dumps(body)
    status, _, body = post(fleet.base_url, SHORT, key)
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    # The static key of the keys file works too.
    assert post(fleet.base_url, SHORT, keys.static)[0] == 200
    # The ingress said why it refused, and named neither key.
    log_path = fleet.ingress.log_path
    wait_for(lambda: log_path.read_text().count('"auth_failed"') >= 2, 10, "auth_failed logged")
    text = log_path.read_text()
    for secret in (bad[17:], key[17:], keys.static[17:]):
        assert secret not in text


def test_the_openai_client_works_with_a_key(fleet: Fleet, keys: Keys, capsys) -> None:
    import openai

    key = keys.create(capsys)
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key=key, max_retries=0)
    reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert reply.usage.completion_tokens == 3
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_a_model_the_key_may_not_use_is_403_and_hidden(fleet: Fleet, keys: Keys, capsys) -> None:
    key = keys.create(capsys, "--models", "some-other-model")
    status, _, body = post(fleet.base_url, SHORT, key)
    assert status == 403 and body["error"]["type"] == "permission_denied_error" and body["error"]["param"] == "model"
    status, _, models = post(fleet.base_url, {}, key, path="/v1/models")
    assert status == 200 and models["data"] == []
    assert post(fleet.base_url, {}, None, path="/v1/models")[0] == 401


def test_the_nats_api_needs_a_key_too(fleet: Fleet, keys: Keys, capsys) -> None:
    key = keys.create(capsys)
    narrow = keys.create(capsys, "--models", "some-other-model")
    body = json.dumps({**SHORT, "max_tokens": 3}).encode()

    async def scenario(nc: nats.NATS) -> dict:
        def auth(k: str) -> dict[str, str]:
            return {"Authorization": f"Bearer {k}"}

        return {
            "none": await nc.request(subjects.API_COMPLETIONS, body, timeout=30),
            "bad": await nc.request(subjects.API_COMPLETIONS, body, timeout=30, headers=auth(key[:-4] + "AAAA")),
            "good": await nc.request(subjects.API_COMPLETIONS, body, timeout=30, headers={"authorization": f"bearer {key}"}),
            "narrow": await nc.request(subjects.API_COMPLETIONS, body, timeout=30, headers=auth(narrow)),
            "models_none": await nc.request(subjects.API_MODELS, b"", timeout=5),
            "models": await nc.request(subjects.API_MODELS, b"", timeout=5, headers=auth(key)),
        }

    replies = nats_run(fleet, scenario)
    assert replies["none"].headers[ERROR_CODE] == "401"
    assert replies["bad"].headers[ERROR_CODE] == "401" and key[:-4].encode() not in replies["bad"].data
    assert ERROR_CODE not in (replies["good"].headers or {})
    assert json.loads(replies["good"].data)["usage"]["completion_tokens"] == 3
    assert replies["narrow"].headers[ERROR_CODE] == "403"
    assert json.loads(replies["narrow"].data)["error"]["type"] == "permission_denied_error"
    assert replies["models_none"].headers[ERROR_CODE] == "401"
    assert [m["id"] for m in json.loads(replies["models"].data)["data"]] == [MODEL]


def test_keys_list_and_revoke(fleet: Fleet, keys: Keys, capsys) -> None:
    key = keys.create(capsys, "--rpm", "100", "--priority-max", "3", tenant="revoked-tenant")
    key_id = key.split("_")[1]
    code, out, _ = keys.cli(capsys, "list", "--json")
    listed = {entry["id"]: entry for entry in map(json.loads, out.splitlines())}
    assert listed[key_id]["tenant"] == "revoked-tenant" and listed[key_id]["rpm"] == 100
    assert listed[key_id]["prefix"] == f"kvl_{key_id}" and "hash" not in listed[key_id]
    code, table, _ = keys.cli(capsys, "list")
    assert code == 0 and key_id in table and "revoked-tenant" in table
    assert key[17:] not in out + table
    assert post(fleet.base_url, SHORT, key)[0] == 200
    code, _, err = keys.cli(capsys, "revoke", key_id)
    assert code == 0, err
    revoked_at = time.monotonic()
    wait_for(lambda: post(fleet.base_url, SHORT, key)[0] == 401, 10, "the revoked key refused")
    # Within the cache's lifetime (plus a request's own time on a busy machine).
    assert time.monotonic() - revoked_at < CACHE_TTL_S + 2.0
    assert keys.cli(capsys, "revoke", key_id)[0] == 1


# --- limits ------------------------------------------------------------------------------------


def test_requests_per_minute(fleet: Fleet, keys: Keys, capsys) -> None:
    key = keys.create(capsys, "--rpm", "3")
    statuses = [post(fleet.base_url, SHORT, key) for _ in range(4)]
    assert [s for s, _, _ in statuses] == [200, 200, 200, 429]
    _, headers, body = statuses[-1]
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(headers["Retry-After"]) <= 60
    metrics = urllib.request.urlopen(f"{fleet.base_url}/metrics", timeout=5).read().decode()
    assert 'kvlane_ingress_tenant_requests_total{status="429",tenant="acme"}' in metrics
    assert 'kvlane_ingress_tenant_requests_total{status="200",tenant="acme"}' in metrics


def test_tokens_per_minute(fleet: Fleet, keys: Keys, capsys) -> None:
    key = keys.create(capsys, "--tpm", "100")
    status, _, body = post(fleet.base_url, {**SHORT, "max_tokens": 200}, key)
    assert status == 429 and body["error"]["code"] == "request_too_large"  # can never fit
    status, _, first = post(fleet.base_url, {**SHORT, "max_tokens": 60}, key)
    assert status == 200
    used = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    status, headers, body = post(fleet.base_url, {**SHORT, "max_tokens": 101 - used - first["usage"]["prompt_tokens"]}, key)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded" and "TPM" in body["error"]["message"]
    assert 1 <= int(headers["Retry-After"]) <= 60
    # What is left of the minute still serves a request that fits.
    assert post(fleet.base_url, {**SHORT, "max_tokens": 100 - used - first["usage"]["prompt_tokens"]}, key)[0] == 200


async def _open_stream(session: aiohttp.ClientSession, base_url: str, key: str) -> tuple[int, aiohttp.ClientResponse]:
    """A long stream, read up to its first chunk; the response stays open (its slot held) until released."""
    response = await session.post(f"{base_url}/v1/completions", json=LONG, headers={"Authorization": f"Bearer {key}"})
    if response.status == 200:
        await response.content.readline()
    return response.status, response


def test_concurrency_is_limited_and_a_slot_frees_when_the_client_leaves(fleet: Fleet, keys: Keys, capsys) -> None:
    key = keys.create(capsys, "--max-concurrency", "2")

    async def scenario() -> tuple[list[int], int, dict, float]:
        async with aiohttp.ClientSession() as session:
            held = [await _open_stream(session, fleet.base_url, key) for _ in range(2)]
            status, refused = await _open_stream(session, fleet.base_url, key)
            body, retry_after = await refused.json(), refused.headers.get("Retry-After")
            refused.release()
            held[0][1].close()  # the client hangs up: its slot must come back
            left_at = time.monotonic()
            deadline = left_at + 10
            while True:
                again, response = await _open_stream(session, fleet.base_url, key)
                response.close()
                if again == 200 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)  # poll again
            freed_after = time.monotonic() - left_at
            held[1][1].close()
            return [s for s, _ in held] + [status], again, {**body, "retry_after": retry_after}, freed_after

    statuses, again, refused, freed_after = asyncio.run(scenario())
    assert statuses == [200, 200, 429]
    assert refused["error"]["code"] == "concurrency_limit_exceeded" and refused["retry_after"] == "1"
    assert again == 200 and freed_after < 10


def test_limits_hold_across_two_ingress_replicas(fleet: Fleet, keys: Keys, capsys) -> None:
    """A second ingress on the same Redis: requests split across both, and each key's limits hold in total."""
    second = _second_ingress(fleet)
    urls = [fleet.base_url, f"http://127.0.0.1:{second[1]}"]
    try:
        # Sequential and alternating: each replica admits 2, then both refuse (alone, each would have allowed 4).
        key = keys.create(capsys, "--rpm", "4")
        statuses = [(i % 2, post(urls[i % 2], SHORT, key)[0]) for i in range(10)]
        assert statuses[:4] == [(0, 200), (1, 200), (0, 200), (1, 200)]
        assert {status for _, status in statuses[4:]} == {429}
        # At once: 16 requests, 8 per replica, race for 5 places.
        burst = keys.create(capsys, "--rpm", "5")

        async def scenario() -> list[int]:
            async with aiohttp.ClientSession() as session:
                async def one(i: int) -> int:
                    async with session.post(f"{urls[i % 2]}/v1/completions", json=SHORT,
                                            headers={"Authorization": f"Bearer {burst}"}) as response:
                        await response.read()
                        return response.status

                return await asyncio.gather(*(one(i) for i in range(16)))

        outcomes = asyncio.run(scenario())
        assert sorted(outcomes) == [200] * 5 + [429] * 11
        # Concurrency: a slot held on one replica counts on the other, and comes back from it.
        conc = keys.create(capsys, "--max-concurrency", "1")

        async def concurrency() -> tuple[int, int, int]:
            async with aiohttp.ClientSession() as session:
                first, held = await _open_stream(session, urls[0], conc)
                other, refused = await _open_stream(session, urls[1], conc)
                refused.release()
                held.close()
                deadline = time.monotonic() + 10
                while True:
                    again, response = await _open_stream(session, urls[1], conc)
                    response.close()
                    if again == 200 or time.monotonic() > deadline:
                        return first, other, again
                    await asyncio.sleep(0.05)  # poll again

        assert asyncio.run(concurrency()) == (200, 429, 200)
    finally:
        second[0].stop()


def _second_ingress(fleet: Fleet) -> tuple[Process, int]:
    port = free_port()
    env = to_env(fleet.config) | {"KVLANE__INGRESS__PORT": str(port), "KVLANE__INGRESS__INGRESS_ID": '"second"'}
    process = fleet.launcher.start_service("ingress", env, name="ingress-second-auth")
    wait_services_ready([process])
    wait_for(lambda: post(f"http://127.0.0.1:{port}", SHORT, None)[0] == 401, 30, "the second ingress answers")
    return process, port

