"""The path floor of `loadtest.dataplane.overhead --path-floor` refuses bad input before it sends anything.

Its successful path needs NATS, Redis and a worker: `tests/integration/test_overhead_bench.py` runs it.
"""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from contracts.messages import ErrorReply, RouteRequest
from loadtest.dataplane.path_floor import Front, Relay, make_app


class _Untouchable:
    """Stands where the bus, the streams and the Redis batch go: bad input must never reach them."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"bad input reached {name}")


@pytest.fixture
async def client():
    async with TestClient(TestServer(make_app(Front(_Untouchable(), _Untouchable())))) as test_client:  # type: ignore[arg-type]
        yield test_client


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b'{"prompt": "no model"}', b'{"model": "m", "prompt": "hi", "max_tokens": 0}',
                                  b'{"model": "m", "prompt": "hi", "max_tokens": "many"}', b'{"model": "m", "prompt": ""}'])
async def test_bad_input_gets_a_400_in_the_openai_error_shape(client: TestClient, data: bytes) -> None:
    response = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_request" and error["message"]


async def test_the_relay_refuses_a_route_with_no_request_to_hand_over() -> None:
    relay = Relay(_Untouchable(), _Untouchable(), object(), "w0")  # type: ignore[arg-type]
    reply = await relay.route(RouteRequest(request_id="r", model="m", prompt_tokens=1, max_tokens=1, timeout_s=1.0), None)
    assert isinstance(reply, ErrorReply) and reply.status == 400
