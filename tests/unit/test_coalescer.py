"""The coalescer: when a burst leaves, and that a burst leaves whole."""

from __future__ import annotations

import asyncio

import pytest

from shared.coalescer import Coalescer


async def iterations_until(condition, limit: int = 10) -> int:
    """Loop iterations (each `sleep(0)` lets every ready callback run once) until `condition()` holds."""
    for iteration in range(limit + 1):
        if condition():
            return iteration
        await asyncio.sleep(0)
    raise AssertionError(f"not within {limit} loop iterations")


@pytest.mark.parametrize(("linger", "iterations"), [(True, 2), (False, 1)])
async def test_a_burst_leaves_after_one_iteration_without_linger_and_two_with_it(linger: bool, iterations: int) -> None:
    flushed: list[list[int]] = []

    async def flush(items: list[int]) -> None:
        flushed.append(items)

    coalescer = Coalescer("test", flush, linger=linger)
    for burst in range(3):  # the first burst starts the coalescer's task; later ones wake it
        coalescer.put(2 * burst)
        coalescer.put(2 * burst + 1)
        assert await iterations_until(lambda: len(flushed) == burst + 1) == iterations
    assert flushed == [[0, 1], [2, 3], [4, 5]]
    await coalescer.close()


async def test_without_linger_the_items_of_tasks_woken_together_leave_in_one_batch() -> None:
    """As an engine step wakes every running request's task and each puts its frame."""
    flushed: list[list[int]] = []

    async def flush(items: list[int]) -> None:
        flushed.append(items)

    coalescer = Coalescer("test", flush, linger=False)
    step = asyncio.Event()

    async def request(number: int) -> None:
        await step.wait()
        coalescer.put(number)

    for _ in range(2):
        tasks = [asyncio.create_task(request(number)) for number in range(8)]
        await asyncio.sleep(0)  # each waits for the step
        step.set()
        await asyncio.gather(*tasks)
        await iterations_until(lambda: len(flushed) == 1 and flushed[0] == list(range(8)))
        flushed.clear()
        step.clear()
    await coalescer.close()
