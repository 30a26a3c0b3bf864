"""The authoritative block ledger in Redis: atomic, shared by all replicas.

Per node a hash holds the blocks reserved in each pool; per request a lease
hash holds what it reserved; a sorted set orders leases by expiry. Every
change is one Lua script, so any number of cache-manager replicas can
allocate concurrently and a node is never over-committed: the script
re-checks room at the moment it reserves. Expired leases (a request whose
worker or ingress died and stopped renewing) are reaped by any replica and
their blocks returned.
"""

from __future__ import annotations

import time

import msgspec
import redis.asyncio as redis

from contracts import subjects
from shared.kv_allocation import NodeAsk, RunningLease
from shared.redis_scripts import run_batch

_PREFIX = f"{subjects.REDIS_PREFIX}:cache"
_LEASES = f"{_PREFIX}:leases"

# One Lua function, so that the balancer's slot-and-lease script (services/balancer/slot_store.py)
# runs the very same allocation as `_ALLOCATE` does alone.
# K: usage hash, lease hash, expiry zset, node lease set
# A: blocks, pool ('general', 'short' or 'short_first'), general capacity, short capacity, expires_at_ms, lease fields...
# Returns {code, pool, count}: 2 granted, 1 held already on this node, 0 refused (count: blocks left in the pool).
ALLOCATE_FUNCTION = """
local function allocate_lease(K, A)
if redis.call('EXISTS', K[2]) == 1 then
  local holder = redis.call('HGET', K[2], 'worker_id')
  if holder == A[6] then
    return {1, redis.call('HGET', K[2], 'pool'), tonumber(redis.call('HGET', K[2], 'blocks'))}
  end
  -- Routed elsewhere (a retry or a resumption): give the old node its blocks back first.
  local old_blocks = tonumber(redis.call('HGET', K[2], 'blocks'))
  redis.call('HINCRBY', A[11] .. holder, 'used_' .. redis.call('HGET', K[2], 'pool'), -old_blocks)
  redis.call('SREM', A[12] .. holder, A[10])
  redis.call('DEL', K[2])
end
local blocks = tonumber(A[1])
-- 'short_first': the short pool if the blocks fit there, else the general one (allocator.pool_for).
local pools = A[2] == 'short_first' and {'short', 'general'} or {A[2]}
local left = 0
for _, pool in ipairs(pools) do
  local field = 'used_' .. pool
  local capacity = pool == 'short' and tonumber(A[4]) or tonumber(A[3])
  local used = tonumber(redis.call('HGET', K[1], field) or '0')
  if used + blocks <= capacity then
    redis.call('HINCRBY', K[1], field, blocks)
    redis.call('HSET', K[2], 'worker_id', A[6], 'blocks', blocks, 'pool', pool, 'priority', A[7],
               'max_tokens', A[8], 'generated', 0, 'granted_at', A[9])
    redis.call('ZADD', K[3], A[5], A[10])
    redis.call('SADD', K[4], A[10])
    return {2, pool, blocks}
  end
  left = capacity - used
end
return {0, A[2], left}
end
"""

_ALLOCATE = ALLOCATE_FUNCTION + "return allocate_lease(KEYS, ARGV)\n"

# Preemption in one step: the victims' leases go and the newcomer's comes, or, when that no longer makes
# room (a victim ended and another request took its blocks, say), nothing changes and no victim is lost.
# KEYS: the allocation's four (usage hash, newcomer's lease hash, expiry zset, node lease set), then each victim's lease hash
# ARGV: the allocation's twelve (its pool one pool), then each victim's request id
# Returns {code, pool, count, the victims released...} as ALLOCATE_FUNCTION's; a victim already gone is not counted.
_PREEMPT = ALLOCATE_FUNCTION + """
local node, pool, blocks = ARGV[6], ARGV[2], tonumber(ARGV[1])
if redis.call('HGET', KEYS[2], 'worker_id') == node then
  return {1, redis.call('HGET', KEYS[2], 'pool'), tonumber(redis.call('HGET', KEYS[2], 'blocks'))}
end
local capacity = pool == 'short' and tonumber(ARGV[4]) or tonumber(ARGV[3])
local room = capacity - tonumber(redis.call('HGET', KEYS[1], 'used_' .. pool) or '0')
local victims = {}
for i = 5, #KEYS do
  if redis.call('HGET', KEYS[i], 'worker_id') == node and redis.call('HGET', KEYS[i], 'pool') == pool then
    room = room + tonumber(redis.call('HGET', KEYS[i], 'blocks'))
    victims[#victims + 1] = i
  end
end
if room < blocks then
  return {0, pool, room}
end
local released = {}
for _, i in ipairs(victims) do
  local rid = ARGV[12 + i - 4]
  redis.call('HINCRBY', KEYS[1], 'used_' .. pool, -tonumber(redis.call('HGET', KEYS[i], 'blocks')))
  redis.call('SREM', KEYS[4], rid)
  redis.call('DEL', KEYS[i])
  redis.call('ZREM', KEYS[3], rid)
  released[#released + 1] = rid
end
local granted = allocate_lease({KEYS[1], KEYS[2], KEYS[3], KEYS[4]}, ARGV)
for _, rid in ipairs(released) do
  granted[#granted + 1] = rid
end
return granted
"""

# KEYS: lease hash, expiry zset; ARGV: request id, usage key prefix, node set prefix, node ('' = any)
_RELEASE = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('ZREM', KEYS[2], ARGV[1])
  return -1
end
local node = redis.call('HGET', KEYS[1], 'worker_id')
if ARGV[4] ~= '' and node ~= ARGV[4] then
  return -1
end
local blocks = tonumber(redis.call('HGET', KEYS[1], 'blocks'))
local pool = redis.call('HGET', KEYS[1], 'pool')
redis.call('HINCRBY', ARGV[2] .. node, 'used_' .. pool, -blocks)
redis.call('SREM', ARGV[3] .. node, ARGV[1])
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return blocks
"""

# KEYS: expiry zset; ARGV: now_ms, lease key prefix, usage key prefix, node set prefix, limit
_REAP = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[5]))
for _, rid in ipairs(expired) do
  local lease = ARGV[2] .. rid
  if redis.call('EXISTS', lease) == 1 then
    local node = redis.call('HGET', lease, 'worker_id')
    local blocks = tonumber(redis.call('HGET', lease, 'blocks'))
    local pool = redis.call('HGET', lease, 'pool')
    redis.call('HINCRBY', ARGV[3] .. node, 'used_' .. pool, -blocks)
    redis.call('SREM', ARGV[4] .. node, rid)
    redis.call('DEL', lease)
  end
  redis.call('ZREM', KEYS[1], rid)
end
return expired
"""

# KEYS: expiry zset; ARGV: expires_at_ms, lease key prefix, then (request id, generated) pairs
_RENEW = """
local renewed = 0
for i = 3, #ARGV, 2 do
  local lease = ARGV[2] .. ARGV[i]
  if redis.call('EXISTS', lease) == 1 then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i])
    redis.call('HSET', lease, 'generated', ARGV[i + 1])
    renewed = renewed + 1
  end
end
return renewed
"""


class Reservation(msgspec.Struct, frozen=True):
    granted: bool
    pool: str
    # Blocks reserved when granted; free blocks left in the pool when not.
    blocks: int
    already_held: bool = False


class Preemption(msgspec.Struct, frozen=True):
    reservation: Reservation
    # The victims whose leases went (none when refused): only these are to be aborted.
    preempted: list[str] = []


def usage_key(worker_id: str) -> str:
    return f"{_PREFIX}:used:{worker_id}"


def lease_key(request_id: str) -> str:
    return f"{_PREFIX}:lease:{request_id}"


def node_leases_key(worker_id: str) -> str:
    return f"{_PREFIX}:node_leases:{worker_id}"


class BlockLedger:
    def __init__(self, client: redis.Redis, lease_ttl_s: float) -> None:
        self._redis = client
        self.lease_ttl_s = lease_ttl_s
        self._allocate = client.register_script(_ALLOCATE)
        self._release = client.register_script(_RELEASE)
        self._reap = client.register_script(_REAP)
        self._renew = client.register_script(_RENEW)
        self._preempt = client.register_script(_PREEMPT)

    def _expiry_ms(self) -> int:
        return int((time.time() + self.lease_ttl_s) * 1000)

    async def reserve(
        self,
        request_id: str,
        worker_id: str,
        blocks: int,
        pool: str,
        general_capacity: int,
        short_capacity: int,
        priority: float,
        max_tokens: int,
    ) -> Reservation:
        keys, args = self.allocate_call(request_id, worker_id, blocks, pool, general_capacity, short_capacity, priority,
                                        max_tokens)
        return reservation_of(await self._allocate(keys=keys, args=args))

    def allocate_call(
        self, request_id: str, worker_id: str, blocks: int, pool: str, general_capacity: int, short_capacity: int,
        priority: float, max_tokens: int,
    ) -> tuple[list, list]:
        """The (KEYS, ARGV) of `ALLOCATE_FUNCTION` for `reserve`'s arguments."""
        keys = [usage_key(worker_id), lease_key(request_id), _LEASES, node_leases_key(worker_id)]
        args = [blocks, pool, general_capacity, short_capacity, self._expiry_ms(), worker_id, priority, max_tokens,
                time.time(), request_id, f"{_PREFIX}:used:", f"{_PREFIX}:node_leases:"]
        return keys, args

    def asked_call(self, request_id: str, worker_id: str, ask: NodeAsk, priority: float, max_tokens: int) -> tuple[list, list]:
        """`allocate_call` for what `kv_allocation.ask_on_node` planned on a node chosen already."""
        return self.allocate_call(request_id, worker_id, ask.blocks, ask.pool, ask.general_capacity, ask.short_capacity,
                                  priority, max_tokens)

    async def reserve_asked(self, request_id: str, worker_id: str, ask: NodeAsk, priority: float, max_tokens: int) -> Reservation:
        """`reserve` what `kv_allocation.ask_on_node` planned for a node chosen already."""
        keys, args = self.asked_call(request_id, worker_id, ask, priority, max_tokens)
        return reservation_of(await self._allocate(keys=keys, args=args))

    async def preempt(
        self, request_id: str, worker_id: str, blocks: int, pool: str, general_capacity: int, short_capacity: int,
        priority: float, max_tokens: int, victims: list[str],
    ) -> Preemption:
        """Release `victims`' leases on `worker_id` and `reserve` in `pool` there, as one atomic step:
        refused as a whole (nothing released) when that no longer makes room."""
        keys, args = self.allocate_call(request_id, worker_id, blocks, pool, general_capacity, short_capacity, priority,
                                        max_tokens)
        reply = await self._preempt(keys=[*keys, *(lease_key(victim) for victim in victims)], args=[*args, *victims])
        reservation = reservation_of(reply[:3])
        preempted = [victim.decode() if isinstance(victim, bytes) else victim for victim in reply[3:]]
        return Preemption(reservation, preempted if reservation.granted else [])

    async def release(self, request_id: str, worker_id: str | None = None) -> int | None:
        """Blocks returned, or None when no such lease exists (released twice, reaped, or held on
        another node than `worker_id`: the late end of an attempt resumed elsewhere)."""
        keys, args = self._release_call(request_id, worker_id)
        return _freed(await self._release(keys=keys, args=args))

    async def release_many(self, releases: list[tuple[str, str | None]]) -> list[int | None]:
        """`release` for each (request_id, worker_id), in one round trip."""
        calls = [self._release_call(request_id, worker_id) for request_id, worker_id in releases]
        return [_freed(freed) for freed in await run_batch(self._redis, self._release, calls)]

    def _release_call(self, request_id: str, worker_id: str | None) -> tuple[list, list]:
        return [lease_key(request_id), _LEASES], [request_id, f"{_PREFIX}:used:", f"{_PREFIX}:node_leases:", worker_id or ""]

    async def renew(self, progress: list[tuple[str, int]]) -> int:
        if not progress:
            return 0
        args: list = [self._expiry_ms(), f"{_PREFIX}:lease:"]
        for request_id, generated in progress:
            args += [request_id, generated]
        return int(await self._renew(keys=[_LEASES], args=args))

    async def reap(self, limit: int = 500) -> list[str]:
        expired = await self._reap(
            keys=[_LEASES],
            args=[int(time.time() * 1000), f"{_PREFIX}:lease:", f"{_PREFIX}:used:", f"{_PREFIX}:node_leases:", limit],
        )
        return [r.decode() for r in expired]

    async def usage(self, worker_ids: list[str]) -> dict[str, tuple[int, int, int]]:
        """Per node: (used general, used short, lease count)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.hmget(usage_key(worker_id), "used_general", "used_short")
                pipe.scard(node_leases_key(worker_id))
            replies = await pipe.execute()
        usage = {}
        for worker_id, (general, short), count in zip(worker_ids, replies[0::2], replies[1::2], strict=True):
            usage[worker_id] = (int(general or 0), int(short or 0), int(count))
        return usage

    async def leases_on(self, worker_id: str) -> list[RunningLease]:
        request_ids = [r.decode() for r in await self._redis.smembers(node_leases_key(worker_id))]
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.hgetall(lease_key(request_id))
            replies = await pipe.execute()
        leases = []
        for request_id, fields in zip(request_ids, replies, strict=True):
            if not fields:
                continue
            f = {k.decode(): v.decode() for k, v in fields.items()}
            leases.append(
                RunningLease(
                    request_id=request_id,
                    worker_id=f["worker_id"],
                    blocks=int(f["blocks"]),
                    pool=f["pool"],  # type: ignore[arg-type]
                    priority=float(f["priority"]),
                    max_tokens=int(f["max_tokens"]),
                    generated=int(f["generated"]),
                    granted_at=float(f["granted_at"]),
                )
            )
        return leases


def reservation_of(reply: list) -> Reservation:
    """The `Reservation` in the reply of `ALLOCATE_FUNCTION`."""
    code, pool, count = reply
    return Reservation(granted=code > 0, pool=pool.decode() if isinstance(pool, bytes) else pool, blocks=int(count),
                       already_held=code == 1)


def _freed(reply: int) -> int | None:
    return None if reply < 0 else int(reply)
