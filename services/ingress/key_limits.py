"""Per-key rate limits in Redis, shared by every ingress replica: one Lua script per admission.

Per key id, four Redis keys with the hash tag `{key:<id>}` (one Redis
Cluster slot; every key a script touches is passed in KEYS):

* `kvlane:v1:{key:<id>}:window`  sorted set, request id -> admitted at (ms):
  the admissions of the last `window_s` (60 s), a sliding log. Requests per
  minute is its size, so "at most rpm in any 60 s" holds exactly.
* `kvlane:v1:{key:<id>}:tokens`  hash, request id -> tokens counted for it:
  prompt + max_tokens at admission, corrected to prompt + the tokens actually
  generated when the request ends (`settle`).
* `kvlane:v1:{key:<id>}:total`   the sum of `tokens` (tokens per minute), kept
  as entries age out of the window, so admission never sums the log.
* `kvlane:v1:{key:<id>}:inflight`  sorted set, request id -> slot expiry (ms):
  the requests running now. `settle` removes one however its request ended;
  the ingress renews the expiry of its running requests every `slot_ttl/3`,
  so the slots of an ingress that crashed free themselves within `slot_ttl`.

The script ages out the log, checks concurrency, then requests, then tokens,
and records the admission only when all three allow it: the check and the
count are one atomic step, so replicas cannot both take the last unit. Time
is the Redis server's (`TIME`), one clock for every replica; tests may pass
their own. Every key gets a TTL, so an idle key id leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import redis.asyncio as redis
from msgspec import Struct

from contracts import subjects
from shared.api_keys import KeyRecord
from shared.redis_scripts import run_batch

WINDOW_S = 60.0

# KEYS: window, tokens, total, inflight
# ARGV: request id, cost (tokens), rpm, tpm, max concurrency (0: no limit), window ms, slot ttl ms, now ms (-1: Redis's clock)
# Returns {1, 'ok', 0} or {0, reason, retry after ms (-1: retrying cannot help)}.
_ADMIT = """
local rid, cost = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, conc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local window, slot_ttl, now = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local windowed = rpm > 0 or tpm > 0
local total = 0
if windowed then
  local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - window)
  local freed = 0
  for i = 1, #old, 500 do
    local chunk = {unpack(old, i, math.min(i + 499, #old))}
    for _, n in ipairs(redis.call('HMGET', KEYS[2], unpack(chunk))) do freed = freed + (tonumber(n) or 0) end
    redis.call('HDEL', KEYS[2], unpack(chunk))
    redis.call('ZREM', KEYS[1], unpack(chunk))
  end
  if freed ~= 0 then redis.call('DECRBY', KEYS[3], freed) end
  total = tonumber(redis.call('GET', KEYS[3]) or '0')
end
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  if redis.call('ZCARD', KEYS[4]) >= conc then
    return {0, 'concurrency', 1000}
  end
end
if rpm > 0 then
  local count = redis.call('ZCARD', KEYS[1])
  if count >= rpm then
    local frees = redis.call('ZRANGE', KEYS[1], count - rpm, count - rpm, 'WITHSCORES')
    return {0, 'rpm', tonumber(frees[2]) + window - now}
  end
end
if tpm > 0 and total + cost > tpm then
  if cost > tpm then
    return {0, 'too_large', -1}
  end
  local need, freed = total + cost - tpm, 0
  local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + (tonumber(redis.call('HGET', KEYS[2], entries[i])) or 0)
    if freed >= need then
      return {0, 'tpm', tonumber(entries[i + 1]) + window - now}
    end
  end
  return {0, 'tpm', window}
end
if windowed then
  redis.call('ZADD', KEYS[1], now, rid)
  redis.call('HSET', KEYS[2], rid, cost)
  redis.call('INCRBY', KEYS[3], cost)
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
end
if conc > 0 then
  redis.call('ZADD', KEYS[4], now + slot_ttl, rid)
  redis.call('PEXPIRE', KEYS[4], slot_ttl + 1000)
end
return {1, 'ok', 0}
"""

# KEYS: window, tokens, total, inflight; ARGV: request id, tokens used (-1: keep what was counted)
_SETTLE = """
redis.call('ZREM', KEYS[4], ARGV[1])
local used = tonumber(ARGV[2])
if used >= 0 then
  local counted = redis.call('HGET', KEYS[2], ARGV[1])
  if counted and redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('HSET', KEYS[2], ARGV[1], used)
    redis.call('INCRBY', KEYS[3], used - tonumber(counted))
  end
end
return 1
"""

# KEYS: inflight; ARGV: slot ttl ms, now ms (-1: Redis's clock), request ids...
_RENEW = """
local ttl, now = tonumber(ARGV[1]), tonumber(ARGV[2])
if now < 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
for i = 3, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], ttl + 1000)
return 1
"""


def limit_keys(key_id: str) -> list[str]:
    """The Redis keys of one key id's limits (window, tokens, total, inflight): one hash tag, one cluster slot."""
    base = f"{subjects.REDIS_PREFIX}:{{key:{key_id}}}"
    return [f"{base}:window", f"{base}:tokens", f"{base}:total", f"{base}:inflight"]


class Verdict(Struct, frozen=True):
    admitted: bool
    # 'ok', or the limit that refused: 'concurrency', 'rpm', 'tpm', 'too_large' (more tokens than the key's tpm).
    reason: str = "ok"
    # When to try again; None when waiting cannot help.
    retry_after_s: float | None = None


class KeyLimiter:
    def __init__(self, client: redis.Redis, window_s: float = WINDOW_S, clock_ms: Callable[[], int] | None = None) -> None:
        """`clock_ms`: milliseconds for tests; by default the Redis server's own clock."""
        self._redis = client
        self._window_ms = int(window_s * 1000)
        self._clock_ms = clock_ms
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)
        self._renew = client.register_script(_RENEW)

    def _now(self) -> int:
        return -1 if self._clock_ms is None else self._clock_ms()

    async def admit(self, record: KeyRecord, request_id: str, cost: int, slot_ttl_s: float) -> Verdict:
        """Count a request of `cost` tokens against its key if every limit allows it (one round trip)."""
        args = [request_id, cost, record.rpm, record.tpm, record.max_concurrency, self._window_ms, int(slot_ttl_s * 1000),
                self._now()]
        admitted, reason, retry_ms = await self._admit(keys=limit_keys(record.id), args=args)
        if admitted:
            return Verdict(True)
        return Verdict(False, reason.decode(), None if retry_ms < 0 else max(retry_ms, 0) / 1000)

    async def settle(self, key_id: str, request_id: str, tokens: int | None) -> None:
        """A request ended: free its concurrency slot, and count `tokens` for it instead of what was reserved."""
        await self._settle(keys=limit_keys(key_id), args=[request_id, -1 if tokens is None else tokens])

    async def renew(self, running: Mapping[str, Sequence[str]], slot_ttl_s: float) -> None:
        """Push back the slot expiry of these running requests (request ids by key id), in one round trip."""
        now, ttl = self._now(), int(slot_ttl_s * 1000)
        calls = [([limit_keys(key_id)[3]], [ttl, now, *request_ids]) for key_id, request_ids in running.items() if request_ids]
        await run_batch(self._redis, self._renew, calls)
