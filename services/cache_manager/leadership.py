"""One replica at a time runs a job that must not run twice: a Redis lock with a TTL.

Jobs that are idempotent on Redis (reaping expired leases is one atomic
script) can run on every replica; a job whose effect is not idempotent
(pre-warming sends prefill requests to workers) runs only where `leading()`
says so. The holder renews the lock each time it asks; one that dies, hangs
or loses Redis stops renewing, and once the TTL passes another replica takes
over. Asked at least twice per TTL, a live holder keeps the lock.
"""

from __future__ import annotations

import redis.asyncio as redis
from redis.exceptions import LockError, RedisError

from contracts import subjects


def leader_key(job: str) -> str:
    return f"{subjects.REDIS_PREFIX}:cache:leader:{job}"


class Leadership:
    def __init__(self, client: redis.Redis, job: str, holder_id: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, not {ttl_s}")
        self._holder_id = holder_id
        # redis-py's lock: SET NX PX to take it, and scripts that renew or release it only for its holder.
        self._lock = client.lock(leader_key(job), timeout=ttl_s, blocking=False, thread_local=False)
        self._leading = False

    async def leading(self) -> bool:
        """Whether this replica leads now: renews the lock it holds, or tries to take a free one."""
        try:
            if self._leading:
                try:
                    await self._lock.reacquire()
                except LockError:  # it expired (this replica stalled past the TTL) and may be another's now
                    self._leading = False
            if not self._leading:
                self._leading = await self._lock.acquire(token=self._holder_id)
        except (RedisError, OSError):
            # Without Redis nobody can tell who leads: stand down until it answers again.
            self._leading = False
        return self._leading

    async def resign(self) -> None:
        """Let another replica take over at once (on a clean stop) rather than after the TTL."""
        if not self._leading:
            return
        self._leading = False
        try:
            await self._lock.release()
        except (LockError, RedisError, OSError):
            pass  # it expires by itself
