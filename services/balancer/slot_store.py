"""The global slot count that balancer replicas share.

`RedisSlotStore` keeps, per chain, a sorted set of the request ids holding
a slot scored by their expiry (ms since the epoch), and per request id a
key naming its chain. Reserving and releasing are Lua scripts, so two
replicas can never both take a chain's last slot. Nothing needs cleaning
up after a crash: expired members are dropped by the next reservation on
the chain and both keys carry a TTL up to the request's deadline. A
restarted worker has a new chain id (`snapshot.chain_id_of`), so it starts
with an empty set.

With a ledger, `reserve_with_lease` takes the slot and the request's KV
lease (shared/block_ledger.py) in one script: one round trip per route
decision, and a refusal of either leaves both untouched.

`LocalSlotStore` is the single-process stand-in: the `SlotTable` alone is
the truth, so every placement is confirmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import redis.asyncio as redis
from msgspec import Struct

from contracts import subjects
from shared.block_ledger import ALLOCATE_FUNCTION, Reservation, reservation_of
from shared.redis_scripts import run_batch

# Functions shared by the slot script and the slot-and-lease script.
# K: chain's sorted set, request's key. `free_room` releases `request_id`'s earlier slot (wherever it was)
# and drops expired members; it returns the chain's count after.
_SLOT_FUNCTIONS = """
local function clock_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function free_room(K, request_id, chain_prefix, now)
  local previous = redis.call('GET', K[2])
  if previous then
    redis.call('ZREM', chain_prefix .. previous, request_id)
    redis.call('DEL', K[2])
  end
  redis.call('ZREMRANGEBYSCORE', K[1], '-inf', now)
  return redis.call('ZCARD', K[1])
end
local function take_slot(K, request_id, chain_id, expires)
  redis.call('ZADD', K[1], expires, request_id)
  redis.call('SET', K[2], chain_id, 'PXAT', expires)
  local last = redis.call('ZRANGE', K[1], -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', K[1], math.max(tonumber(last[2]), expires))
end
"""

# KEYS: chain's sorted set, request's key; ARGV: request id, chain id, slots, expires_at_ms, chain key prefix
_RESERVE = _SLOT_FUNCTIONS + """
local now = clock_ms()
local request_id, chain_id, slots, expires = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local used = free_room(KEYS, request_id, ARGV[5], now)
if used >= slots or expires <= now then
  return {0, used}
end
take_slot(KEYS, request_id, chain_id, expires)
return {1, used + 1}
"""

# A slot and the request's KV lease on the same node in one step: either both are taken or neither.
# KEYS: the slot's two, then the ledger's four (block_ledger.ALLOCATE_FUNCTION)
# ARGV: the slot's five, then the ledger's twelve
# Returns {slot taken, chain's count, lease code, pool, blocks}; lease code -1: the slot was refused, the lease not tried.
_RESERVE_WITH_LEASE = _SLOT_FUNCTIONS + ALLOCATE_FUNCTION + """
local now = clock_ms()
local request_id, chain_id, slots, expires = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local used = free_room(KEYS, request_id, ARGV[5], now)
if used >= slots or expires <= now then
  return {0, used, -1, '', 0}
end
local lease = allocate_lease({KEYS[3], KEYS[4], KEYS[5], KEYS[6]}, {unpack(ARGV, 6)})
if lease[1] == 0 then
  return {0, used, 0, lease[2], lease[3]}
end
take_slot(KEYS, request_id, chain_id, expires)
return {1, used + 1, lease[1], lease[2], lease[3]}
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


class SlotAndLease(Struct, frozen=True):
    """What one slot-and-lease reservation did: both were taken, or neither."""

    slot_taken: bool
    # The chain's count after.
    used: int
    # The ledger's answer (refused: no room for the blocks); None when the slot was refused first.
    lease: Reservation | None


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
        self._reserve_with_lease = client.register_script(_RESERVE_WITH_LEASE)
        self._release = client.register_script(_RELEASE)
        self._chain_prefix = chain_slots_key("")

    async def reserve(self, request_id: str, chain_id: str, slots: int, expires_at: float) -> tuple[bool, int]:
        taken, used = await self._reserve(
            keys=[chain_slots_key(chain_id), request_slot_key(request_id)],
            args=[request_id, chain_id, slots, int(expires_at * 1000), self._chain_prefix],
        )
        return bool(taken), int(used)

    async def reserve_with_lease(self, request_id: str, chain_id: str, slots: int, expires_at: float,
                                 lease_call: tuple[list, list]) -> SlotAndLease:
        """`reserve` and the ledger's allocation (`BlockLedger.allocate_call`) in one atomic round trip."""
        lease_keys, lease_args = lease_call
        taken, used, code, pool, blocks = await self._reserve_with_lease(
            keys=[chain_slots_key(chain_id), request_slot_key(request_id), *lease_keys],
            args=[request_id, chain_id, slots, int(expires_at * 1000), self._chain_prefix, *lease_args],
        )
        lease = None if code < 0 else reservation_of([code, pool, blocks])
        return SlotAndLease(bool(taken), int(used), lease)

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
