"""Lua script calls in one Redis round trip.

redis-py's pipeline asks the server whether its scripts exist before every
execute (`SCRIPT EXISTS`, a round trip of its own), which would double the
cost of a batch. This sends plain EVALSHAs and loads a script only when
the server says it lacks it (after a Redis restart, say), then runs the
calls that found none again: a call that found no script did nothing. On a
Redis Cluster the pipeline sends each call to its keys' node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

# One call: the script, its keys, its arguments.
ScriptCall = tuple[AsyncScript, Sequence[Any], Sequence[Any]]


async def run_calls(client: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Each call's reply, in order, in one pipeline; a failed call's reply is its exception, not raised."""
    replies = await _pipelined(client, calls)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[i][0]): calls[i][0] for i in missing}.values():
            script.sha = await client.script_load(script.script)
        for i, reply in zip(missing, await _pipelined(client, [calls[i] for i in missing]), strict=True):
            replies[i] = reply
    return replies


async def run_batch(client: redis.Redis, script: AsyncScript, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]) -> list[Any]:
    """The script's reply for each (keys, args) in `calls`, in order; a failed call raises."""
    if not calls:
        return []
    replies = await run_calls(client, [(script, keys, args) for keys, args in calls])
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


async def _pipelined(client: redis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    async with client.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            # Not `pipe.evalsha`: a cluster pipeline refuses that name, yet routes the command by its keys.
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)
