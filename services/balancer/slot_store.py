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
lease (shared/kv/block_ledger.py) in one script: one round trip per route
decision, and a refusal of either leaves both untouched. Its release
frees the request's lease with the slot, in the same script: the slot's
key may be gone (it expired at the request's deadline while the request
ran on) or name another chain, and the lease still goes. A replica that
did not place the request reads its chain with a script that frees the
lease at once. Every replica releases every finished request and the
ledger credits a lease's blocks once (`block_ledger.RELEASE_FUNCTION`).
The balancers thus free every lease they take; the cache-managers only
reap those nobody freed (a crashed balancer's, say). The reservations
asked for within one event-loop iteration go to Redis in one pipeline
(`ScriptBatch`): each script still runs atomically on its own, so nothing
changes for replica safety, while a burst of route decisions costs one
round trip and one socket write instead of one per decision. On a single
Redis the batch is packed by hiredis and exchanged on one pooled connection
rather than through redis-py's pipeline, whose per-command bookkeeping cost
the balancer about twice the CPU per script call.

Every key of a chain and of its requests carries its node's hash tag
(`block_ledger.node_tag`), like the node's ledger keys, so on a Redis
Cluster that one script runs on one master. A slot is therefore found
through its node: releasing needs the node, and a request reserved on
another node keeps its first slot until that attempt's end releases it
or its deadline passes.

The tenants' fair-share counters (`fair_share.TenantShares`) live beside
the slots: two hashes, each tenant's service (charges add up) and its lift
(the largest any replica set). A placement's charge, and an end's
settlement, ride along with the next batch of reservations and releases
(or go just before the next usage read, when none comes), never awaited by
the route decision: no round trip per request; every usage read brings
the counters back in its pipeline. Both keys carry one hash tag, so on a
Redis Cluster the script runs on one master; idle for a day, they lapse,
which changes nothing (with nothing active, every tenant starts level).

`LocalSlotStore` is the single-process stand-in: the `SlotTable` alone is
the truth, so every placement is confirmed. Its release frees the
request's lease through the balancer's allocator (`KvAllocator.release_many`),
so with either store whatever frees a request's slot frees its lease.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import hiredis
import redis.asyncio as redis
from msgspec import Struct
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, ResponseError

from contracts import subjects
from shared.kv.block_ledger import (
    ALLOCATE_FUNCTION,
    RELEASE_FUNCTION,
    Reservation,
    node_tag,
    release_keys,
    reservation_of,
)
from services.balancer.fair_share import SharedCounters, TenantCharge
from shared.redis_scripts import run_calls

# Functions shared by the slot script and the slot-and-lease script.
# K: chain's sorted set, request's key on the chain's node. `free_room` releases `request_id`'s earlier slot on
# this chain and drops expired members; it returns the chain's count after.
_SLOT_FUNCTIONS = """
local function clock_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function free_room(K, request_id, now)
  redis.call('ZREM', K[1], request_id)
  redis.call('DEL', K[2])
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

# Expiries are set on Redis's clock from the time left (ms) that the balancer sends, so balancers on hosts whose
# clocks disagree still agree on when a reservation lapses.
# KEYS: chain's sorted set, request's key; ARGV: request id, chain id, slots, ms left
_RESERVE = _SLOT_FUNCTIONS + """
local now = clock_ms()
local request_id, chain_id, slots, left = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local expires = now + left
local used = free_room(KEYS, request_id, now)
if used >= slots or left <= 0 then
  return {0, used}
end
take_slot(KEYS, request_id, chain_id, expires)
return {1, used + 1}
"""

# A slot and the request's KV lease on the same node in one step: either both are taken or neither.
# KEYS: the slot's two, then the ledger's four (block_ledger.ALLOCATE_FUNCTION), all in the node's slot
# ARGV: the slot's four, then the ledger's ten
# Returns {slot taken, chain's count, lease code, pool, blocks}; lease code -1: the slot was refused, the lease not tried.
_RESERVE_WITH_LEASE = _SLOT_FUNCTIONS + ALLOCATE_FUNCTION + """
local now = clock_ms()
local request_id, chain_id, slots, left = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local expires = now + left
local used = free_room(KEYS, request_id, now)
if used >= slots or left <= 0 then
  return {0, used, -1, '', 0}
end
local lease = allocate_lease({KEYS[3], KEYS[4], KEYS[5], KEYS[6]}, {unpack(ARGV, 5)})
if lease[1] == 0 then
  return {0, used, 0, lease[2], lease[3]}
end
take_slot(KEYS, request_id, chain_id, expires)
return {1, used + 1, lease[1], lease[2], lease[3]}
"""

# The request's slot on the chain named (the one this replica placed it on, or a read just before found in its key):
# nothing if its key names another chain or none. Given the ledger's keys too, the request's KV lease on the node,
# whatever became of the slot.
# KEYS: request's key, that chain's sorted set, then optionally the ledger's four (block_ledger.release_keys)
# ARGV: request id, chain id
# Returns {chain's count after, or -1 when the slot was not there; the lease's blocks given back, or -1 when none}
_RELEASE = RELEASE_FUNCTION + """
local freed = -1
if #KEYS > 2 then
  freed = release_lease({KEYS[3], KEYS[4], KEYS[5], KEYS[6]}, ARGV[1])
end
if redis.call('GET', KEYS[1]) ~= ARGV[2] then
  return {-1, freed}
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return {redis.call('ZCARD', KEYS[2]), freed}
"""


# For a request whose chain is not known here: the chain its key names (empty if none), to release the slot on next,
# and, given the ledger's keys too, its KV lease on the node freed at once (the lease needs no chain).
# KEYS: request's key, then optionally the ledger's four (block_ledger.release_keys); ARGV: request id
# Returns {the chain or '', the lease's blocks given back or -1 when none}
_READ_AND_RELEASE_LEASE = RELEASE_FUNCTION + """
local freed = -1
if #KEYS > 1 then
  freed = release_lease({KEYS[2], KEYS[3], KEYS[4], KEYS[5]}, ARGV[1])
end
return {redis.call('GET', KEYS[1]) or '', freed}
"""


# KEYS: the tenants' service hash, their lift hash; ARGV: tenant, service to add, lift (kept if the largest)
_CHARGE = """
redis.call('HINCRBYFLOAT', KEYS[1], ARGV[1], ARGV[2])
if tonumber(ARGV[3]) > (tonumber(redis.call('HGET', KEYS[2], ARGV[1])) or 0) then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
end
redis.call('PEXPIRE', KEYS[1], 86400000)
redis.call('PEXPIRE', KEYS[2], 86400000)
return 1
"""
TENANT_SERVICE_KEY = f"{subjects.REDIS_PREFIX}:{{tenants}}:service"
TENANT_LIFT_KEY = f"{subjects.REDIS_PREFIX}:{{tenants}}:lift"


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

    async def release(self, request_id: str, worker_id: str) -> tuple[str, int] | None:
        """Free `request_id`'s slot on `worker_id`'s chain and its KV lease on `worker_id`; (chain, its count after),
        or None if it held no slot there (see `SlotTable.release`). Idempotent."""
        ...

    async def release_many(self, releases: Sequence[tuple[str, str]],
                           chains: Sequence[str | None] | None = None) -> list[tuple[str, int] | None]:
        """`release` for each (request_id, worker_id), in one batch. `chains`: for each, the chain on that node
        its slot is known to be on (None where not known); a release is the same with or without it."""
        ...

    async def usage(self, chain_ids: Sequence[str], now: float) -> dict[str, int]:
        """Slots in use per chain, counting only unexpired reservations."""
        ...

    async def usage_and_counters(self, chain_ids: Sequence[str], now: float) -> tuple[dict[str, int], SharedCounters | None]:
        """`usage`, and the tenants' shared counters (None: the store keeps none)."""
        ...

    def charge(self, charge: TenantCharge) -> asyncio.Future | None:
        """Add to a tenant's shared counter, in the background (nothing to do for a store no replica shares); the
        reply, for a caller that must know it was made."""
        ...


class LocalSlotStore:
    _release_leases: Callable[[Sequence[tuple[str, str]]], Awaitable[None]] | None = None

    def __init__(self, release_leases: Callable[[Sequence[tuple[str, str]]], Awaitable[None]] | None = None) -> None:
        """`release_leases`: frees the KV leases of (request_id, worker_id) pairs (`KvAllocator.release_many`);
        None where the balancer takes no leases."""
        self._release_leases = release_leases

    async def reserve(self, request_id: str, chain_id: str, slots: int, expires_at: float) -> tuple[bool, int]:
        return True, -1

    async def release(self, request_id: str, worker_id: str) -> tuple[str, int] | None:
        return (await self.release_many([(request_id, worker_id)]))[0]

    async def release_many(self, releases: Sequence[tuple[str, str]],
                           chains: Sequence[str | None] | None = None) -> list[tuple[str, int] | None]:
        if releases and self._release_leases is not None:
            await self._release_leases(releases)
        return [None] * len(releases)

    async def usage(self, chain_ids: Sequence[str], now: float) -> dict[str, int]:
        return {}

    async def usage_and_counters(self, chain_ids: Sequence[str], now: float) -> tuple[dict[str, int], SharedCounters | None]:
        return await self.usage(chain_ids, now), None

    def charge(self, charge: TenantCharge) -> asyncio.Future | None:
        return None


def worker_of(chain_id: str) -> str:
    """The node of a chain (`snapshot.chain_id_of`: `<worker_id>@<started_at ms>`)."""
    return chain_id.rpartition("@")[0] or chain_id


def chain_slots_key(chain_id: str) -> str:
    return f"{subjects.REDIS_PREFIX}:slots:{node_tag(worker_of(chain_id))}:{chain_id}"


def request_slot_key(worker_id: str, request_id: str) -> str:
    return f"{subjects.REDIS_PREFIX}:slot:{node_tag(worker_id)}:{request_id}"


def ms_left(expires_at: float) -> int:
    """The time until `expires_at` on this host's wall clock, for a script that sets the expiry on Redis's."""
    return int((expires_at - time.time()) * 1000)


class ScriptBatch:
    """Script calls made while the previous batch is out, sent together in one pipeline.

    The first call of a burst starts a flush that waits one loop iteration, so
    every call made in that iteration joins it; calls made while a batch is
    out wait for it and go in the next one, so under load batches grow rather
    than round trips queueing up. Each call gets its own reply or error: a
    failed call fails only its caller, a lost connection every caller of the
    batch.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        # A cluster client's pipeline sends each call to its keys' node; a single Redis takes the batch on one
        # connection of its pool.
        self._pool = client.connection_pool if isinstance(client, redis.Redis) else None
        self._pending: list[tuple[AsyncScript, list, list, asyncio.Future]] = []
        self._flush_task: asyncio.Task | None = None

    def call(self, script: AsyncScript, keys: list, args: list, ride_along: bool = False) -> asyncio.Future:
        """The script's reply, once its batch is back. `ride_along`: it starts no batch of its own, and goes with the
        next one another call starts (or `send_riders`)."""
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        self._pending.append((script, keys, args, reply))
        if self._flush_task is None and not ride_along:
            self._flush_task = loop.create_task(self._flush(), name="slot-reservations")
        return reply

    async def send_riders(self) -> None:
        """Send the calls left to ride along (with the batch on its way, if one is), and wait until they are sent."""
        if not self._pending:
            return
        if self._flush_task is None:
            self._flush_task = asyncio.get_running_loop().create_task(self._flush(), name="slot-reservations")
        await asyncio.shield(self._flush_task)

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # the other decisions of this iteration add their calls first
            while self._pending:
                batch, self._pending = self._pending, []
                await self._send(batch)
        finally:
            self._flush_task = None
            if self._pending:  # cancelled: nobody will send these
                batch, self._pending = self._pending, []
                for *_, waiter in batch:
                    waiter.cancel()

    async def _send(self, batch: list[tuple[AsyncScript, list, list, asyncio.Future]]) -> None:
        calls = [(script, keys, args) for script, keys, args, _ in batch]
        try:
            replies = await (run_calls(self._redis, calls) if self._pool is None else self._run_on_connection(calls))
        except Exception as exc:
            for *_, waiter in batch:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        except BaseException:
            for *_, waiter in batch:
                waiter.cancel()
            raise
        for (*_, waiter), reply in zip(batch, replies, strict=True):
            if waiter.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(reply, Exception):
                waiter.set_exception(reply)
            else:
                waiter.set_result(reply)

    async def _run_on_connection(self, calls: list[tuple[AsyncScript, list, list]]) -> list[Any]:
        """`run_calls` on a single Redis: each call's reply, or its error, in order; a script the server lacks
        (after a restart, say) is loaded and the calls that found none run again (they did nothing)."""
        replies = await self._exchange(calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
                script.sha = await self._redis.script_load(script.script)
            for i, reply in zip(missing, await self._exchange([calls[i] for i in missing]), strict=True):
                replies[i] = reply
        return replies

    async def _exchange(self, calls: list[tuple[AsyncScript, list, list]]) -> list[Any]:
        """Send every call as one write on one pooled connection and read each reply (retried, as redis-py's
        pipeline is, on a lost connection; the connection drops itself on any error that leaves replies unread)."""
        packed = b"".join([hiredis.pack_command(("EVALSHA", script.sha, len(keys), *keys, *args))
                           for script, keys, args in calls])
        pool = self._pool
        assert pool is not None
        connection = await pool.get_connection()

        async def exchange() -> list[Any]:
            await connection.send_packed_command(packed)
            replies: list[Any] = []
            # One deadline for the batch, not one per reply; a read it cuts short drops the connection.
            async with asyncio.timeout(connection.socket_timeout):
                for _ in calls:
                    try:
                        replies.append(await connection.read_response(timeout=math.inf))
                    except ResponseError as error:  # this call's error: the others' replies follow it
                        replies.append(error)
            return replies

        async def lost(error: Exception) -> None:
            await connection.disconnect()

        try:
            return await connection.retry.call_with_retry(exchange, lost)
        finally:
            await pool.release(connection)


class RedisSlotStore:
    def __init__(self, client: redis.Redis) -> None:
        """Every release frees the request's KV lease on the node as well: the ledger shares this Redis."""
        self._redis = client
        self._reserve = client.register_script(_RESERVE)
        self._reserve_with_lease = client.register_script(_RESERVE_WITH_LEASE)
        self._release = client.register_script(_RELEASE)
        self._read_and_release_lease = client.register_script(_READ_AND_RELEASE_LEASE)
        self._charge = client.register_script(_CHARGE)
        self._batch = ScriptBatch(client)

    async def reserve(self, request_id: str, chain_id: str, slots: int, expires_at: float) -> tuple[bool, int]:
        taken, used = await self._batch.call(
            self._reserve,
            [chain_slots_key(chain_id), request_slot_key(worker_of(chain_id), request_id)],
            [request_id, chain_id, slots, ms_left(expires_at)],
        )
        return bool(taken), int(used)

    async def reserve_with_lease(self, request_id: str, chain_id: str, slots: int, expires_at: float,
                                 lease_call: tuple[list, list]) -> SlotAndLease:
        """`reserve` and the ledger's allocation (`BlockLedger.allocate_call`, on the chain's node) in one atomic round trip."""
        lease_keys, lease_args = lease_call
        taken, used, code, pool, blocks = await self._batch.call(
            self._reserve_with_lease,
            [chain_slots_key(chain_id), request_slot_key(worker_of(chain_id), request_id), *lease_keys],
            [request_id, chain_id, slots, ms_left(expires_at), *lease_args],
        )
        lease = None if code < 0 else reservation_of([code, pool, blocks])
        return SlotAndLease(bool(taken), int(used), lease)

    async def release(self, request_id: str, worker_id: str) -> tuple[str, int] | None:
        return (await self.release_many([(request_id, worker_id)]))[0]

    async def release_many(self, releases: Sequence[tuple[str, str]],
                           chains: Sequence[str | None] | None = None) -> list[tuple[str, int] | None]:
        if not releases:
            return []
        released: list[tuple[str, int] | None] = [None] * len(releases)
        # Where the chain is known (this replica placed the request) the release goes straight into the next
        # batch of scripts, with the route decisions'. Its script checks the request's key still names that chain,
        # and frees the lease either way.
        known = [i for i, chain_id in enumerate(chains or ()) if chain_id is not None]
        if known:
            replies = await _gathered(self._release_calls([(*releases[i], chains[i], True) for i in known]))  # type: ignore[index]
            for i, reply in zip(known, replies, strict=True):
                released[i] = _released(chains[i], reply)  # type: ignore[index]
        # The others, and a request that moved to another chain of its node meanwhile: a request's key names
        # its chain, whose set the script must be given: read first, then release. A script reads it, in the
        # batch, so that the lease of a request whose chain was not known goes in the same step: most often the
        # replica that placed it has freed both already, and nothing more is sent.
        unknown = [i for i in range(len(releases)) if released[i] is None]
        if not unknown:
            return released
        with_lease = set(unknown).difference(known)
        read = await _gathered([
            self._batch.call(self._read_and_release_lease,
                             [request_slot_key(releases[i][1], releases[i][0]),
                              *(self._lease_keys(*releases[i]) if i in with_lease else ())],
                             [releases[i][0]])
            for i in unknown])
        held = [(i, chain_id.decode()) for i, (chain_id, _) in zip(unknown, read, strict=True) if chain_id]
        replies = await _gathered(self._release_calls([(*releases[i], chain_id, False) for i, chain_id in held]))
        for (i, chain_id), reply in zip(held, replies, strict=True):
            released[i] = _released(chain_id, reply)
        return released

    def _release_calls(self, releases: Sequence[tuple[str, str, str, bool]]) -> list[asyncio.Future]:
        """The release script for each (request_id, worker_id, chain_id, with its lease), in the next batch."""
        return [self._batch.call(self._release, [request_slot_key(worker_id, request_id), chain_slots_key(chain_id),
                                                 *(self._lease_keys(request_id, worker_id) if lease else ())],
                                 [request_id, chain_id])
                for request_id, worker_id, chain_id, lease in releases]

    def _lease_keys(self, request_id: str, worker_id: str) -> list[str]:
        """The ledger's keys a release frees the request's lease through (benchmarks of slots alone give none)."""
        return release_keys(worker_id, request_id)

    async def usage(self, chain_ids: Sequence[str], now: float) -> dict[str, int]:
        if not chain_ids:
            return {}
        return (await self._read(chain_ids, now, False))[0]

    async def usage_and_counters(self, chain_ids: Sequence[str], now: float) -> tuple[dict[str, int], SharedCounters | None]:
        await self._batch.send_riders()  # charges no reservation or release took along: the read then counts them
        return await self._read(chain_ids, now, True)

    async def _read(self, chain_ids: Sequence[str], now: float, counters: bool) -> tuple[dict[str, int], SharedCounters | None]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for chain_id in chain_ids:
                pipe.zcount(chain_slots_key(chain_id), f"({int(now * 1000)}", "+inf")
            if counters:
                pipe.hgetall(TENANT_SERVICE_KEY)
                pipe.hgetall(TENANT_LIFT_KEY)
            replies = await pipe.execute()
        usage = dict(zip(chain_ids, (int(c) for c in replies[:len(chain_ids)]), strict=True))
        if not counters:
            return usage, None
        service, lift = ({_text(k): float(v) for k, v in reply.items()} for reply in replies[len(chain_ids):])
        return usage, SharedCounters(service, lift)

    def charge(self, charge: TenantCharge) -> asyncio.Future:
        reply = self._batch.call(self._charge, [TENANT_SERVICE_KEY, TENANT_LIFT_KEY],
                                 [charge.tenant, repr(charge.service), repr(charge.lift)], ride_along=True)
        # Nobody waits for it: a lost charge is the next read's to correct, and must not be reported as unretrieved.
        reply.add_done_callback(lambda done: done.cancelled() or done.exception())
        return reply


async def _gathered(replies: list[asyncio.Future]) -> list[Any]:
    """Each batched call's reply; the first failure raises (after every call is done)."""
    if not replies:
        return []
    done = await asyncio.gather(*replies, return_exceptions=True)
    for reply in done:
        if isinstance(reply, BaseException):
            raise reply
    return done


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _released(chain_id: str, reply: list) -> tuple[str, int] | None:
    """(chain, its count after) from the release script's reply; None when the slot was not there."""
    used = int(reply[0])
    return None if used < 0 else (chain_id, used)
