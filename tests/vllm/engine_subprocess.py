"""What the test subprocesses that drive `VllmEngine`s directly share (tests/vllm/pd_pair.py,
tests/vllm/test_vllm_prefix_pull.py): a request's outputs collected, and the one "RESULT {json}" line their
parent test reads (`tests.vllm.conftest.run_json_module`)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable


async def collect(engine, request) -> dict:
    """The request's tokens, text, finish reason and cached tokens, as the engine produced them."""
    token_ids: list[int] = []
    text, reason, cached = "", None, 0
    async for output in engine.generate(request):
        token_ids += output.token_ids
        text += output.text
        reason, cached = output.finish_reason, output.cached_tokens
    return {"token_ids": token_ids, "text": text, "finish_reason": reason, "cached_tokens": cached}


def print_result(run: Callable[[dict], Awaitable[dict]]) -> None:
    """Run `run` on the JSON spec read from stdin and print its result as the parent expects it."""
    spec = json.load(sys.stdin)
    from services.worker.amx import request_amx_permission

    request_amx_permission()
    print("RESULT " + json.dumps(asyncio.run(run(spec))), flush=True)
