"""Fair share, live through `kvlane up` with two API keys: tenant A keeps the one sim worker's slots and the queue full,
while tenant B sends one request at a time. With fair share B's TTFT stays within its SLO; in arrival order (the
control, `balancer.queue.fair_share = false`) B waits behind A's queue and misses it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from launch.launcher import free_port
from loadtest.bench.metrics import percentile
from shared.api_keys import make_record, write_keys_file
from tests.integration.conftest import MODEL, start_kvlane_up, stop_kvlane_up

pytestmark = pytest.mark.integration

SLOTS = 4  # the worker's max_num_seqs: the balancer's slots on it
A_CLIENTS = 40  # A's streams at once: ten times the slots, so A always has requests waiting
A_TOKENS = 256  # long enough that a queue of A's takes seconds to drain
B_REQUESTS = 12
B_TTFT_SLO_S = 3.0


@contextmanager
def fleet(tmp_path: Path, fair_share: bool, keys: Path) -> Iterator[str]:
    """`kvlane up` with one sim worker of `SLOTS` slots and keys required; yields the base URL."""
    nats_port, redis_port, port = free_port(), free_port(), free_port()
    config = tmp_path / "kvlane.toml"
    config.write_text("\n".join([
        "[nats]", f'url = "nats://127.0.0.1:{nats_port}"', "[redis]", f'url = "redis://127.0.0.1:{redis_port}/0"',
        "[worker.sim]", f"max_num_seqs = {SLOTS}",
        "[balancer.queue]", f"fair_share = {'true' if fair_share else 'false'}", "cache_aware_dequeue = false",
        "[ingress.auth]", "required = true", f'keys_file = "{keys}"', "",
    ]))
    up = start_kvlane_up(config, port, tmp_path / "logs", "--workers", "1")
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if "base URL" in line:
                break
        else:
            pytest.fail(f"kvlane up ended before serving (exit {up.wait()})")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_kvlane_up(up)


async def first_token_s(session: aiohttp.ClientSession, base_url: str, key: str, max_tokens: int) -> float:
    """Seconds to the first token of one streamed completion (which must succeed)."""
    body = {"model": MODEL, "prompt": "fair share", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    sent = time.monotonic()
    first = None
    async with session.post(f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.monotonic() - sent
    assert first is not None
    return first


async def b_ttfts(base_url: str, key_a: str, key_b: str) -> list[float]:
    """B's TTFTs, one request after another, while A's clients each send request after request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        b_done = asyncio.Event()

        async def a_client() -> None:
            while not b_done.is_set():
                await first_token_s(session, base_url, key_a, A_TOKENS)

        clients = [asyncio.create_task(a_client()) for _ in range(A_CLIENTS)]
        try:
            # A fills the slots and the queue first: B arrives to a busy fleet.
            await first_token_s(session, base_url, key_a, A_TOKENS)
            ttfts = [await first_token_s(session, base_url, key_b, 8) for _ in range(B_REQUESTS)]
        finally:
            b_done.set()
            await asyncio.gather(*clients)
        return ttfts


@pytest.mark.parametrize("fair_share", [True, False], ids=["fair", "arrival-order"])
def test_a_tenant_bursting_does_not_hold_back_another(tmp_path: Path, fair_share: bool) -> None:
    record_a, key_a = make_record("tenant-a")
    record_b, key_b = make_record("tenant-b")
    keys = tmp_path / "keys.json"
    write_keys_file(keys, [record_a, record_b])
    with fleet(tmp_path, fair_share, keys) as base_url:
        ttfts = sorted(asyncio.run(b_ttfts(base_url, key_a, key_b)))
    p99 = percentile(ttfts, 99)
    print(f"fair_share={fair_share}: B's TTFT p99 {p99:.2f}s (p50 {percentile(ttfts, 50):.2f}s) while A bursts")
    if fair_share:
        assert p99 <= B_TTFT_SLO_S, ttfts
    else:  # the control: in arrival order B waits behind A's queue
        assert p99 > B_TTFT_SLO_S, ttfts
