"""Cluster state for a process that hosts many simulated nodes.

Each node heartbeats once a second; 256 nodes writing their Redis keys one
round trip each cost the process more CPU than anything else it does when
idle. Here the heartbeats of a short window go out in one pipeline, and
each node's `put_heartbeat` returns (or raises) when its batch is written.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as redis
from redis.exceptions import RedisError

from contracts.messages import Heartbeat
from shared.state import ClusterState


class BatchedClusterState(ClusterState):
    def __init__(self, client: redis.Redis, ttl_s: float, window_s: float) -> None:
        super().__init__(client, ttl_s)
        self._window_s = window_s
        self._pending: list[tuple[Heartbeat, asyncio.Future[None]]] = []
        self._flushes: set[asyncio.Task] = set()

    async def put_heartbeat(self, heartbeat: Heartbeat) -> None:
        loop = asyncio.get_running_loop()
        written: asyncio.Future[None] = loop.create_future()
        self._pending.append((heartbeat, written))
        if len(self._pending) == 1:
            loop.call_later(self._window_s, self._start_flush)
        await written

    def _start_flush(self) -> None:
        task = asyncio.get_running_loop().create_task(self._flush(), name="heartbeat-batch")
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        batch, self._pending = self._pending, []
        # A node's newest heartbeat only: one that waited a whole window behind another is older.
        newest = {heartbeat.registration.worker_id: heartbeat for heartbeat, _ in batch}
        try:
            await self.put_heartbeats(list(newest.values()))
        except (RedisError, OSError) as exc:
            for _, written in batch:
                if not written.done():  # not a node that stopped waiting (it left)
                    written.set_exception(exc)
        else:
            for _, written in batch:
                if not written.done():
                    written.set_result(None)
