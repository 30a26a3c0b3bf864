"""Many calls of one Lua script in one Redis round trip.

redis-py's pipeline asks the server whether its scripts exist before every
execute (`SCRIPT EXISTS`, a round trip of its own), which would double the
cost of a batch. This sends plain EVALSHAs and loads the script only when
the server says it lacks it (after a Redis restart, say), then runs the
batch again: the script is missing for all of its calls or none. On a
Redis Cluster the pipeline sends each call to its keys' node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError


async def run_batch(client: redis.Redis, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list[Any]:
    """The script's reply for each (keys, args) in `calls`, in order; a failed call raises."""
    if not calls:
        return []
    for attempt in (1, 2):
        async with client.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                # Not `pipe.evalsha`: a cluster pipeline refuses that name, yet routes the command by its keys.
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            replies = await pipe.execute(raise_on_error=False)
        if attempt == 1 and any(isinstance(reply, NoScriptError) for reply in replies):
            script.sha = await client.script_load(script.script)
            continue
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies
    raise AssertionError("unreachable")
