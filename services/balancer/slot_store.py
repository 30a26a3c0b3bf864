"""The global slot count that balancer replicas share.

`RedisSlotStore` keeps, per chain, a sorted set of the request ids holding
a slot scored by their expiry (ms since the epoch), and per request id a
key naming its chain. Reserving and releasing are Lua scripts, so two
replicas can never both take a chain's last slot. Nothing needs cleaning
up after a crash: expired members are dropped by the next reservation on
the chain and both keys carry a TTL up to the request's deadline. A
restarted worker has a new chain id (`snapshot.chain_id_of`), so it starts
with an empty set.

`LocalSlotStore` is the single-process stand-in: the `SlotTable` alone is
the truth, so every placement is confirmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import redis.asyncio as redis

from contracts import subjects
from shared.redis_scripts import run_batch

_RESERVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local request_id, chain_id, slots, expires = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local previous = redis.call('GET', KEYS[2])
if previous then
  redis.call('ZREM', ARGV[5] .. previous, request_id)
  redis.call('DEL', KEYS[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local used = redis.call('ZCARD', KEYS[1])
if used >= slots or expires <= now then
  return {0, used}
end
redis.call('ZADD', KEYS[1], expires, request_id)
redis.call('SET', KEYS[2], chain_id, 'PXAT', expires)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], math.max(tonumber(last[2]), expires))
return {1, used + 1}
"""

_RELEASE = """
local chain_id = redis.call('GET', KEYS[1])
if not chain_id then
  return false
end
if ARGV[3] ~= '' and string.sub(chain_id, 1, #ARGV[3] + 1) ~= ARGV[3] .. '@' then
  return false
end
redis.call('DEL', KEYS[1])
local key = ARGV[2] .. chain_id
redis.call('ZREM', key, ARGV[1])
return {chain_id, redis.call('ZCARD', key)}
"""


class SlotStore(Protocol):
    async def reserve(self, request_id: str, chain_id: str, slots: int, expires_at: float) -> tuple[bool, int]:
        """Take a slot globally unless `slots` are in use; (taken, chain's count after). Releases any earlier slot of `request_id`."""
        ...

    async def release(self, request_id: str, worker_id: str | None = None) -> tuple[str, int] | None:
        """Free `request_id`'s slot; (chain, its count after), or None if it held none. Idempotent.

        With `worker_id`, only a slot on that worker's chain (see `SlotTable.release`)."""
        ...

    async def release_many(self, releases: Sequence[tuple[str, str | None]]) -> list[tuple[str, int] | None]:
        """`release` for each (request_id, worker_id), in one round trip."""
        ...

    async def usage(self, chain_ids: Sequence[str], now: float) -> dict[str, int]:
        """Slots in use per chain, counting only unexpired reservations."""
        ...


class LocalSlotStore:
    async def reserve(self, request_id: str, chain_id: str, slots: int, expires_at: float) -> tuple[bool, int]:
        return True, -1

    async def release(self, request_id: str, worker_id: str | None = None) -> tuple[str, int] | None:
        return None

    async def release_many(self, releases: Sequence[tuple[str, str | None]]) -> list[tuple[str, int] | None]:
        return [None] * len(releases)

    async def usage(self, chain_ids: Sequence[str], now: float) -> dict[str, int]:
        return {}


def chain_slots_key(chain_id: str) -> str:
    return f"{subjects.REDIS_PREFIX}:slots:{chain_id}"


def request_slot_key(request_id: str) -> str:
    return f"{subjects.REDIS_PREFIX}:slot:{request_id}"


class RedisSlotStore:
    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._reserve = client.register_script(_RESERVE)
        self._release = client.register_script(_RELEASE)
        self._chain_prefix = chain_slots_key("")

    async def reserve(self, request_id: str, chain_id: str, slots: int, expires_at: float) -> tuple[bool, int]:
        taken, used = await self._reserve(
            keys=[chain_slots_key(chain_id), request_slot_key(request_id)],
            args=[request_id, chain_id, slots, int(expires_at * 1000), self._chain_prefix],
        )
        return bool(taken), int(used)

    async def release(self, request_id: str, worker_id: str | None = None) -> tuple[str, int] | None:
        keys, args = self._release_call(request_id, worker_id)
        return _released(await self._release(keys=keys, args=args))

    async def release_many(self, releases: Sequence[tuple[str, str | None]]) -> list[tuple[str, int] | None]:
        calls = [self._release_call(request_id, worker_id) for request_id, worker_id in releases]
        return [_released(reply) for reply in await run_batch(self._redis, self._release, calls)]

    def _release_call(self, request_id: str, worker_id: str | None) -> tuple[list, list]:
        return [request_slot_key(request_id)], [request_id, self._chain_prefix, worker_id or ""]

    async def usage(self, chain_ids: Sequence[str], now: float) -> dict[str, int]:
        if not chain_ids:
            return {}
        async with self._redis.pipeline(transaction=False) as pipe:
            for chain_id in chain_ids:
                pipe.zcount(chain_slots_key(chain_id), f"({int(now * 1000)}", "+inf")
            counts = await pipe.execute()
        return dict(zip(chain_ids, (int(c) for c in counts), strict=True))


def _released(reply) -> tuple[str, int] | None:
    if not reply:
        return None
    chain_id, used = reply
    return (chain_id.decode() if isinstance(chain_id, bytes) else chain_id), int(used)
