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

# KEYS: usage hash, lease hash, expiry zset, node lease set
# ARGV: blocks, pool ('general', 'short' or 'short_first'), general capacity, short capacity, expires_at_ms, lease fields...
_ALLOCATE = """
if redis.call('EXISTS', KEYS[2]) == 1 then
  local holder = redis.call('HGET', KEYS[2], 'worker_id')
  if holder == ARGV[6] then
    return {1, redis.call('HGET', KEYS[2], 'pool'), tonumber(redis.call('HGET', KEYS[2], 'blocks'))}
  end
  -- Routed elsewhere (a retry or a resumption): give the old node its blocks back first.
  local old_blocks = tonumber(redis.call('HGET', KEYS[2], 'blocks'))
  redis.call('HINCRBY', ARGV[11] .. holder, 'used_' .. redis.call('HGET', KEYS[2], 'pool'), -old_blocks)
  redis.call('SREM', ARGV[12] .. holder, ARGV[10])
  redis.call('DEL', KEYS[2])
end
local blocks = tonumber(ARGV[1])
-- 'short_first': the short pool if the blocks fit there, else the general one (allocator.pool_for).
local pools = ARGV[2] == 'short_first' and {'short', 'general'} or {ARGV[2]}
local left = 0
for _, pool in ipairs(pools) do
  local field = 'used_' .. pool
  local capacity = pool == 'short' and tonumber(ARGV[4]) or tonumber(ARGV[3])
  local used = tonumber(redis.call('HGET', KEYS[1], field) or '0')
  if used + blocks <= capacity then
    redis.call('HINCRBY', KEYS[1], field, blocks)
    redis.call('HSET', KEYS[2], 'worker_id', ARGV[6], 'blocks', blocks, 'pool', pool, 'priority', ARGV[7],
               'max_tokens', ARGV[8], 'generated', 0, 'granted_at', ARGV[9])
    redis.call('ZADD', KEYS[3], ARGV[5], ARGV[10])
    redis.call('SADD', KEYS[4], ARGV[10])
    return {2, pool, blocks}
  end
  left = capacity - used
end
return {0, ARGV[2], left}
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
        code, got_pool, count = await self._allocate(
            keys=[usage_key(worker_id), lease_key(request_id), _LEASES, node_leases_key(worker_id)],
            args=[blocks, pool, general_capacity, short_capacity, self._expiry_ms(), worker_id, priority, max_tokens,
                  time.time(), request_id, f"{_PREFIX}:used:", f"{_PREFIX}:node_leases:"],
        )
        pool_name = got_pool.decode() if isinstance(got_pool, bytes) else got_pool
        return Reservation(granted=code > 0, pool=pool_name, blocks=int(count), already_held=code == 1)

    async def reserve_asked(self, request_id: str, worker_id: str, ask: NodeAsk, priority: float, max_tokens: int) -> Reservation:
        """`reserve` what `kv_allocation.ask_on_node` planned for a node chosen already."""
        return await self.reserve(request_id, worker_id, ask.blocks, ask.pool, ask.general_capacity, ask.short_capacity,
                                  priority, max_tokens)

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


def _freed(reply: int) -> int | None:
    return None if reply < 0 else int(reply)
