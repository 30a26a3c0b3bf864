"""An async Python client for kvlane's OpenAI API over NATS.

    async with await KvlaneClient.connect("nats://127.0.0.1:4222") as client:
        reply = await client.chat_completions({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        async for chunk in client.stream_chat_completions({"model": "m", "messages": [...]}):
            print(chunk["choices"][0]["delta"].get("content", ""), end="")

Bodies are the OpenAI JSON bodies, as dicts. An error reply raises
`KvlaneApiError` with the HTTP status and the OpenAI error body.

Against a secured NATS (docs/security.md), connect with the settings'
credentials, TLS and inbox prefix (`_INBOX.client.<user>`):
`KvlaneClient.connect(**nats_options(load_config(path).nats))`, with
`shared.credentials.nats_options`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from contracts import subjects


class KvlaneApiError(Exception):
    """The API answered with an error: `status` is its HTTP status, `body` the OpenAI error body."""

    def __init__(self, status: int, message: str, body: dict[str, Any] | None = None) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.body = body or {}


class KvlaneClient:
    def __init__(self, nc: NatsClient, timeout: float = 600.0, owns_connection: bool = False) -> None:
        """`timeout`: how long to wait for a reply, or for each chunk of a stream."""
        self._nc = nc
        self._timeout = timeout
        self._owns_connection = owns_connection

    @classmethod
    async def connect(cls, servers: str | list[str] = "nats://127.0.0.1:4222", timeout: float = 600.0, **options: Any) -> KvlaneClient:
        return cls(await nats.connect(servers, **options), timeout, owns_connection=True)

    async def close(self) -> None:
        if self._owns_connection:
            await self._nc.close()

    async def __aenter__(self) -> KvlaneClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def models(self) -> dict[str, Any]:
        return await self._request(subjects.API_MODELS, b"")

    async def chat_completions(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self._request(subjects.API_CHAT_COMPLETIONS, _encode(body, stream=False), headers)

    async def completions(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self._request(subjects.API_COMPLETIONS, _encode(body, stream=False), headers)

    def stream_chat_completions(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        return self._stream(subjects.API_CHAT_COMPLETIONS, _encode(body, stream=True), headers)

    def stream_completions(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        return self._stream(subjects.API_COMPLETIONS, _encode(body, stream=True), headers)

    async def messages(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The Anthropic Messages API: the message."""
        return await self._request(subjects.API_MESSAGES, _encode(body, stream=False), headers)

    def stream_messages(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The Anthropic Messages API, streamed: each event (its `type` says which)."""
        return self._stream(subjects.API_MESSAGES, _encode(body, stream=True), headers)

    async def responses(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The OpenAI Responses API: the response (stored, and continued with `previous_response_id`, by any ingress)."""
        return await self._request(subjects.API_RESPONSES, _encode(body, stream=False), headers)

    def stream_responses(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
        return self._stream(subjects.API_RESPONSES, _encode(body, stream=True), headers)

    async def tokenize(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self._request(subjects.API_TOKENIZE, json.dumps(dict(body)).encode(), headers)

    async def detokenize(self, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        return await self._request(subjects.API_DETOKENIZE, json.dumps(dict(body)).encode(), headers)

    async def _request(self, subject: str, payload: bytes, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        try:
            msg = await self._nc.request(subject, payload, timeout=self._timeout, headers=dict(headers or {}) or None)
        except nats.errors.NoRespondersError as exc:
            raise KvlaneApiError(503, "no kvlane ingress is serving the NATS API") from exc
        except nats.errors.TimeoutError as exc:
            raise KvlaneApiError(504, f"no reply within {self._timeout:.0f}s") from exc
        _raise_for_error(msg)
        return json.loads(msg.data)

    async def _stream(self, subject: str, payload: bytes, headers: Mapping[str, str] | None) -> AsyncIterator[dict[str, Any]]:
        """Chunks in order until the end of the stream. Leaving early unsubscribes, which aborts the request."""
        inbox = self._nc.new_inbox()
        subscription = await self._nc.subscribe(inbox)
        try:
            await self._nc.publish(subject, payload, reply=inbox, headers=dict(headers or {}) or None)
            expected = 0
            while True:
                try:
                    msg = await subscription.next_msg(timeout=self._timeout)
                except nats.errors.TimeoutError as exc:
                    raise KvlaneApiError(504, f"no chunk within {self._timeout:.0f}s") from exc
                if _status(msg) == "503":
                    raise KvlaneApiError(503, "no kvlane ingress is serving the NATS API")
                _raise_for_error(msg)
                if (msg.headers or {}).get(subjects.API_STREAM_HEADER) == subjects.API_STREAM_END:
                    return
                seq = int((msg.headers or {}).get(subjects.API_SEQ_HEADER, expected))
                if seq != expected:
                    raise KvlaneApiError(502, f"stream chunk {expected} is missing (got {seq})")
                expected += 1
                yield json.loads(msg.data)
        finally:
            await asyncio.shield(subscription.unsubscribe())


def _encode(body: Mapping[str, Any], stream: bool) -> bytes:
    return json.dumps({**body, "stream": stream}).encode()


def _status(msg: Msg) -> str | None:
    return (msg.headers or {}).get("Status")


def _raise_for_error(msg: Msg) -> None:
    headers = msg.headers or {}
    code = headers.get(ERROR_CODE_HEADER)
    if code is None:
        return
    try:
        body = json.loads(msg.data) if msg.data else {}
    except ValueError:
        body = {}
    raise KvlaneApiError(int(code), headers.get(ERROR_HEADER, ""), body)
