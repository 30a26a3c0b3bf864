"""Streaming HTTP client for kvlane's OpenAI-compatible API, timing every token.

Each request goes out with `stream: true` and `stream_options.include_usage`,
naming its record's `model` (a LoRA adapter) or else the client's, and its
`RequestRecord` keeps: the model it named, when it was sent, when each content chunk
arrived (the first one is the first token), when the stream ended, the usage
the server reported (prompt, completion and cached tokens), the HTTP status,
any error, and the `X-Request-Id` header (the id workers use in their
`RequestFinished` events, which tell which worker ran it).

Times are seconds on `time.perf_counter()` minus the run's start, so records
of one run compare directly. Only 127.0.0.1 is a valid target: this is a
load generator, and it must not be pointed at anything but a local fleet.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import aiohttp

from loadtest.bench.workloads import Api
from shared.config import TENANT_HEADER

ALLOWED_HOST = "127.0.0.1"


@dataclass
class RequestRecord:
    session_id: str
    group: str
    turn: int
    api: Api
    max_tokens: int
    scheduled_s: float  # when the workload wanted it sent (open loop); sent_s - scheduled_s is client lag
    sent_s: float = 0.0
    priority: int = 0
    tenant: str = ""
    # The `model` it names: its session's LoRA adapter, else ("" until sent) the client's model.
    model: str = ""
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one per content chunk (one token each on sim)
    end_s: float | None = None
    status: int | None = None
    error: str | None = None
    request_id: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    # The answer, needed to continue a conversation; left out of JSON results.
    text: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.end_s is not None

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "text"}
        data["token_times_s"] = [round(t, 6) for t in self.token_times_s]
        return data


def check_local(base_url: str) -> str:
    parsed = urlparse(base_url)
    if parsed.scheme != "http" or parsed.hostname != ALLOWED_HOST or not parsed.port:
        raise ValueError(f"refusing to load-test {base_url!r}: only http://{ALLOWED_HOST}:<port> is allowed")
    return base_url.rstrip("/")


class StreamingClient:
    """One aiohttp session; `send` runs one streamed request and never raises for request failures."""

    def __init__(self, base_url: str, model: str, request_timeout_s: float, clock_origin: float,
                 max_connections: int = 1024) -> None:
        self._base_url = check_local(base_url)
        self._model = model
        self._timeout_s = request_timeout_s
        self._origin = clock_origin
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> StreamingClient:
        # A connection cap far above the run's concurrency: a cap that binds
        # would queue requests inside the client and inflate their TTFT.
        connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=None)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=self._timeout_s))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    async def served_models(self) -> set[str]:
        """The ids `/v1/models` lists now (base models and adapters); none when it does not answer."""
        assert self._session is not None, "use `async with StreamingClient(...)`"
        try:
            async with self._session.get(self._base_url + "/v1/models") as response:
                if response.status != 200:
                    return set()
                listing = await response.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return set()
        return {model["id"] for model in listing.get("data") or ()}

    async def send(self, record: RequestRecord, body: dict[str, Any]) -> RequestRecord:
        """Stream one request into `record` (times, usage, text, status or error)."""
        assert self._session is not None, "use `async with StreamingClient(...)`"
        path = "/v1/chat/completions" if record.api == "chat" else "/v1/completions"
        record.model = record.model or self._model
        payload = {**body, "model": record.model, "max_tokens": record.max_tokens, "stream": True,
                   "stream_options": {"include_usage": True}}
        pieces: list[str] = []
        record.sent_s = self.now()
        try:
            async with asyncio.timeout(self._timeout_s):
                # The tenant as a client without an API key names it (`ingress.tenant_header`'s default).
                headers = {TENANT_HEADER: record.tenant} if record.tenant else None
                async with self._session.post(self._base_url + path, json=payload, headers=headers) as response:
                    record.status = response.status
                    record.request_id = response.headers.get("X-Request-Id")
                    if response.status != 200:
                        record.error = f"http_{response.status}: {(await response.text())[:200]}"
                        return record
                    await self._read_stream(response, record, pieces)
        except TimeoutError:
            record.error = f"timeout after {self._timeout_s:g}s"
        except (aiohttp.ClientError, OSError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            record.text = "".join(pieces)
        if record.error is None and record.end_s is None:
            record.error = "stream ended without [DONE]"
        return record

    async def _read_stream(self, response: aiohttp.ClientResponse, record: RequestRecord, pieces: list[str]) -> None:
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            now = self.now()
            if data == b"[DONE]":
                record.end_s = now
                return
            try:
                event = json.loads(data)
            except ValueError:
                record.error = f"malformed event: {data[:120]!r}"
                return
            if "error" in event:
                error = event["error"]
                record.error = f"stream_error: {error.get('code') if isinstance(error, dict) else error}"
                continue  # [DONE] follows; the record stays failed
            text = _chunk_text(event, record.api)
            if text:
                if record.first_token_s is None:
                    record.first_token_s = now
                record.token_times_s.append(now)
                pieces.append(text)
            for choice in event.get("choices") or ():
                if choice.get("finish_reason"):
                    record.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if usage:
                record.prompt_tokens = usage.get("prompt_tokens")
                record.completion_tokens = usage.get("completion_tokens")
                record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _chunk_text(event: dict[str, Any], api: Api) -> str:
    choices = event.get("choices") or ()
    if not choices:
        return ""
    choice = choices[0]
    if api == "chat":
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""
