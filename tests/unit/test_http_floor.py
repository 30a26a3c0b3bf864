"""The HTTP floor of `loadtest.dataplane.overhead --http-floor` answers a completion from memory, and bad input with a 400."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from loadtest.dataplane.http_floor import make_app


@pytest.fixture
async def client():
    async with TestClient(TestServer(make_app())) as test_client:
        yield test_client


async def test_a_completion_has_the_tokens_asked_for(client: TestClient) -> None:
    response = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 3})
    assert response.status == 200
    body = await response.json()
    assert body["model"] == "m" and body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("data", [b"{not json", b"[1, 2]", b'{"prompt": "no model"}', b'{"model": "m", "max_tokens": 0}',
                                  b'{"model": "m", "max_tokens": "many"}'])
async def test_bad_input_gets_a_400_in_the_openai_error_shape(client: TestClient, data: bytes) -> None:
    response = await client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
    assert response.status == 400
    error = (await response.json())["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
