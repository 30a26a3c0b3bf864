"""Stored responses (`store: true`) in Redis, so that every ingress replica can continue or return any of them.

vLLM keeps them in its server's memory, for ever; kvlane keeps each under
one key with a TTL (`ingress.responses_ttl_s`). One key per response and
plain GET/SET: it works the same on a Redis Cluster.
"""

from __future__ import annotations

import msgspec
import redis.asyncio as redis

from contracts import subjects
from contracts.responses_api import StoredResponse
from services.ingress.errors import ApiError

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(StoredResponse)


class ResponseStore:
    def __init__(self, client: redis.Redis, ttl_s: float) -> None:
        self._client = client
        self._ttl_s = max(1, round(ttl_s))

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            raw = await self._client.get(subjects.response_key(response_id))
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc
        if raw is None:
            return None
        try:
            return _DECODER.decode(raw)
        except msgspec.DecodeError:
            return None  # written by an incompatible version: as good as gone

    async def put(self, stored: StoredResponse) -> None:
        try:
            await self._client.set(subjects.response_key(stored.response.id), _ENCODER.encode(stored), ex=self._ttl_s)
        except redis.RedisError as exc:
            raise _unavailable(exc) from exc


def _unavailable(exc: Exception) -> ApiError:
    # Answering without storing would leave the client a response id that no replica can continue.
    return ApiError(503, f"the response store is unavailable: {exc}", code="response_store_unavailable")
