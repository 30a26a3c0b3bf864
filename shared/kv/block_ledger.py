"""The authoritative block ledger in Redis: atomic, shared by all replicas.

Per node a hash holds the blocks reserved in each pool, a set names its
leases and a sorted set orders them by expiry; per request a lease hash on
the node holds what it reserved. Every change is one Lua script, so any
number of cache-manager replicas can allocate concurrently and a node is
never over-committed: the script re-checks room at the moment it reserves.
Expired leases (a request whose worker or ingress died and stopped
renewing) are reaped by any replica and their blocks returned.

Every key of one node carries the hash tag `{node:<worker_id>}` and every
script gets all its keys in KEYS, so on a Redis Cluster each script runs on
the one master holding that node's slot, and the fleet spreads over the
masters. Hence a lease is found through its node: releasing needs the node
(a release that knows only the request tries each node it is given), and a
request allocated again on another node leaves its lease on the first one
until that attempt's end releases it, or it expires. Reaping visits each
node in an index that the reapers keep from the nodes they see alive.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
import redis.asyncio as redis

from contracts import subjects
from shared.kv.allocation import NodeAsk, RunningLease
from shared.redis_scripts import run_batch

_PREFIX = f"{subjects.REDIS_PREFIX}:cache"
# Nodes whose leases reaping visits: those seen alive, kept until a departed one has no lease left.
LEDGER_NODES_KEY = f"{_PREFIX}:nodes"

# One Lua function, so that the balancer's slot-and-lease script (services/balancer/slot_store.py)
# runs the very same allocation as `_ALLOCATE` does alone.
# K: the node's usage hash, the request's lease hash on the node, the node's expiry zset, the node's lease set
# A: blocks, pool ('general', 'short' or 'short_first'), general capacity, short capacity, ms the lease lasts,
#    worker id, priority, max_tokens, granted_at, request id
# Returns {code, pool, count}: 2 granted, 1 held already on this node, 0 refused (count: blocks left in the pool).
ALLOCATE_FUNCTION = """
-- Expiries are on Redis's clock, so hosts whose clocks disagree still agree on when a lease lapses.
local function ledger_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function allocate_lease(K, A)
if redis.call('EXISTS', K[2]) == 1 then
  return {1, redis.call('HGET', K[2], 'pool'), tonumber(redis.call('HGET', K[2], 'blocks'))}
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
    redis.call('ZADD', K[3], ledger_now_ms() + tonumber(A[5]), A[10])
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
# ARGV: the allocation's ten (its pool one pool), then each victim's request id
# Returns {code, pool, count, the victims released...} as ALLOCATE_FUNCTION's; a victim already gone is not counted.
_PREEMPT = ALLOCATE_FUNCTION + """
local pool, blocks = ARGV[2], tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {1, redis.call('HGET', KEYS[2], 'pool'), tonumber(redis.call('HGET', KEYS[2], 'blocks'))}
end
local capacity = pool == 'short' and tonumber(ARGV[4]) or tonumber(ARGV[3])
local room = capacity - tonumber(redis.call('HGET', KEYS[1], 'used_' .. pool) or '0')
local victims = {}
for i = 5, #KEYS do
  if redis.call('HGET', KEYS[i], 'pool') == pool then
    room = room + tonumber(redis.call('HGET', KEYS[i], 'blocks'))
    victims[#victims + 1] = i
  end
end
if room < blocks then
  return {0, pool, room}
end
local released = {}
for _, i in ipairs(victims) do
  local rid = ARGV[10 + i - 4]
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

# One Lua function, so that the balancer's slot release (services/balancer/slot_store.py) frees a finished request's
# lease in its own script exactly as `RELEASE_SCRIPT` does alone.
# K: the request's lease hash on the node, the node's expiry zset, usage hash, lease set (`release_keys`)
# Returns the blocks given back, or -1 when the node holds no such lease. Only the lease hash credits blocks, and
# releasing or reaping deletes it, so however many callers release a lease (every balancer replica, a reaper
# that got there first) its blocks come back once.
RELEASE_FUNCTION = """
local function release_lease(K, request_id)
if redis.call('EXISTS', K[1]) == 0 then
  redis.call('ZREM', K[2], request_id)
  return -1
end
local blocks = tonumber(redis.call('HGET', K[1], 'blocks'))
redis.call('HINCRBY', K[3], 'used_' .. redis.call('HGET', K[1], 'pool'), -blocks)
redis.call('SREM', K[4], request_id)
redis.call('DEL', K[1])
redis.call('ZREM', K[2], request_id)
return blocks
end
"""

# KEYS: `release_keys`; ARGV: request id
RELEASE_SCRIPT = RELEASE_FUNCTION + "return release_lease(KEYS, ARGV[1])\n"

# The expired leases of one node, found by a read just before: one renewed since is kept.
# KEYS: the node's expiry zset, usage hash, lease set, then each candidate's lease hash
# ARGV: the reader's now_ms (unused: Redis's clock decides), then each candidate's request id
_REAP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expired = {}
for i = 4, #KEYS do
  local rid = ARGV[i - 2]
  local expires = redis.call('ZSCORE', KEYS[1], rid)
  if expires and tonumber(expires) <= now then
    if redis.call('EXISTS', KEYS[i]) == 1 then
      local blocks = tonumber(redis.call('HGET', KEYS[i], 'blocks'))
      redis.call('HINCRBY', KEYS[2], 'used_' .. redis.call('HGET', KEYS[i], 'pool'), -blocks)
      redis.call('SREM', KEYS[3], rid)
      redis.call('DEL', KEYS[i])
    end
    redis.call('ZREM', KEYS[1], rid)
    expired[#expired + 1] = rid
  end
end
return expired
"""

# KEYS: the node's expiry zset, then each lease hash; ARGV: ms the leases last from now, then (request id, generated) pairs
_RENEW = """
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local renewed = 0
for i = 2, #KEYS do
  local rid = ARGV[2 * i - 2]
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('ZADD', KEYS[1], 'XX', expires, rid)
    redis.call('HSET', KEYS[i], 'generated', ARGV[2 * i - 1])
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


def node_tag(worker_id: str) -> str:
    """The hash tag of every key of one node: on a Redis Cluster they share a slot."""
    return f"{{node:{worker_id}}}"


def usage_key(worker_id: str) -> str:
    return f"{_PREFIX}:used:{node_tag(worker_id)}"


def lease_key(worker_id: str, request_id: str) -> str:
    return f"{_PREFIX}:lease:{node_tag(worker_id)}:{request_id}"


def node_leases_key(worker_id: str) -> str:
    return f"{_PREFIX}:node_leases:{node_tag(worker_id)}"


def expiry_key(worker_id: str) -> str:
    return f"{_PREFIX}:leases:{node_tag(worker_id)}"


def release_keys(worker_id: str, request_id: str) -> list[str]:
    """The KEYS of `RELEASE_FUNCTION` for `request_id`'s lease on `worker_id`: all in that node's slot."""
    return [lease_key(worker_id, request_id), expiry_key(worker_id), usage_key(worker_id), node_leases_key(worker_id)]


class BlockLedger:
    def __init__(self, client: redis.Redis, lease_ttl_s: float) -> None:
        self._redis = client
        self.lease_ttl_s = lease_ttl_s
        self._allocate = client.register_script(_ALLOCATE)
        self._release = client.register_script(RELEASE_SCRIPT)
        self._reap = client.register_script(_REAP)
        self._renew = client.register_script(_RENEW)
        self._preempt = client.register_script(_PREEMPT)

    def _lease_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

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
        """The (KEYS, ARGV) of `ALLOCATE_FUNCTION` for `reserve`'s arguments: all keys in `worker_id`'s slot."""
        keys = [usage_key(worker_id), lease_key(worker_id, request_id), expiry_key(worker_id), node_leases_key(worker_id)]
        args = [blocks, pool, general_capacity, short_capacity, self._lease_ms(), worker_id, priority, max_tokens,
                time.time(), request_id]
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
        victim_keys = [lease_key(worker_id, victim) for victim in victims]
        reply = await self._preempt(keys=[*keys, *victim_keys], args=[*args, *victims])
        reservation = reservation_of(reply[:3])
        preempted = [victim.decode() if isinstance(victim, bytes) else victim for victim in reply[3:]]
        return Preemption(reservation, preempted if reservation.granted else [])

    async def release(self, request_id: str, worker_id: str) -> int | None:
        """Blocks returned, or None when `worker_id` holds no such lease (released twice, reaped, or held on
        another node: the late end of an attempt resumed elsewhere)."""
        return (await self.release_many([(request_id, worker_id)]))[0]

    async def release_many(self, releases: Sequence[tuple[str, str]]) -> list[int | None]:
        """`release` for each (request_id, worker_id), in one round trip."""
        calls = [(release_keys(worker_id, request_id), [request_id]) for request_id, worker_id in releases]
        return [_freed(freed) for freed in await run_batch(self._redis, self._release, calls)]

    async def release_on_any(self, request_id: str, worker_ids: Sequence[str]) -> int | None:
        """`release` where only the request is known: tried on each of `worker_ids` in one round trip.
        A request holds a lease on one node at most, but for a moment after a retry elsewhere; each goes."""
        freed = [blocks for blocks in await self.release_many([(request_id, w) for w in worker_ids]) if blocks is not None]
        return sum(freed) if freed else None

    async def renew(self, worker_id: str, progress: list[tuple[str, int]]) -> int:
        """Push back the expiry of `worker_id`'s leases in `progress` (request id, tokens generated so far)."""
        if not progress:
            return 0
        keys = [expiry_key(worker_id), *(lease_key(worker_id, request_id) for request_id, _ in progress)]
        args: list = [self._lease_ms()]
        for request_id, generated in progress:
            args += [request_id, generated]
        return int(await self._renew(keys=keys, args=args))

    async def reap(self, live_worker_ids: Sequence[str] = (), limit: int = 500) -> list[str]:
        """Free every expired lease of the nodes alive now and of those seen alive before (up to `limit` per node).

        `live_worker_ids` join the index of nodes to visit; a node no longer alive leaves it once it holds no lease."""
        if live_worker_ids:
            await self._redis.sadd(LEDGER_NODES_KEY, *live_worker_ids)
        nodes = sorted(member.decode() for member in await self._redis.smembers(LEDGER_NODES_KEY))
        if not nodes:
            return []
        now_ms = int(time.time() * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in nodes:
                pipe.zrangebyscore(expiry_key(worker_id), "-inf", now_ms, start=0, num=limit)
                pipe.zcard(expiry_key(worker_id))
            replies = await pipe.execute()
        calls, departed = [], []
        for worker_id, expired, count in zip(nodes, replies[0::2], replies[1::2], strict=True):
            request_ids = [r.decode() for r in expired]
            if request_ids:
                keys = [expiry_key(worker_id), usage_key(worker_id), node_leases_key(worker_id),
                        *(lease_key(worker_id, request_id) for request_id in request_ids)]
                calls.append((keys, [now_ms, *request_ids]))
            if worker_id not in live_worker_ids and count == len(request_ids):
                departed.append(worker_id)
        reaped = [r.decode() for reply in await run_batch(self._redis, self._reap, calls) for r in reply]
        if departed:
            # A departed node that held leases still may have one allocated since the read: kept if so.
            counts = await self._counts(departed)
            gone = [worker_id for worker_id, count in zip(departed, counts, strict=True) if count == 0]
            if gone:
                await self._redis.srem(LEDGER_NODES_KEY, *gone)
        return reaped

    async def _counts(self, worker_ids: Sequence[str]) -> list[int]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for worker_id in worker_ids:
                pipe.zcard(expiry_key(worker_id))
            return [int(count) for count in await pipe.execute()]

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
                pipe.hgetall(lease_key(worker_id, request_id))
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
