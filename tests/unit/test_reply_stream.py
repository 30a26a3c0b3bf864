"""`ReplyStream`: the frames of one streamed reply, read by the task relaying them to a client."""

from __future__ import annotations

import asyncio

import pytest

from contracts.messages import StreamEnd, Timings, TokenChunk, Usage
from shared.bus import ReplyStream, RequestTimeout


def end() -> StreamEnd:
    return StreamEnd("r", 1, "stop", Usage(1, 1, 0), Timings(None, 0.0), "w")


async def test_frames_come_in_order_and_silence_times_out() -> None:
    stream = ReplyStream("r", "s", lambda request_id: None)
    stream.put(TokenChunk("r", 0, [5], "five"))
    stream.put(end())
    assert isinstance(await stream.next(1.0), TokenChunk)
    assert isinstance(await stream.next(1.0), StreamEnd)
    with pytest.raises(RequestTimeout):
        await stream.next(0.01)


async def test_a_reader_cancelled_as_a_frame_arrives_stays_cancelled() -> None:
    """A reader whose task is cancelled (its client hung up) must not go on reading, even when a
    frame lands in the same loop iteration: Python 3.11's `asyncio.wait_for` returned the frame."""
    for _ in range(20):
        stream = ReplyStream("r", "s", lambda request_id: None)
        reader = asyncio.create_task(stream.next(5.0))
        await asyncio.sleep(0)  # the reader waits for a frame now
        stream.put(end())
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader


async def test_a_longer_wait_outlives_the_timer_of_a_shorter_one() -> None:
    """The stream keeps one timer: one armed for a short wait that a frame ended must not end a longer wait after it."""
    loop = asyncio.get_running_loop()
    stream = ReplyStream("r", "s", lambda request_id: None)
    loop.call_later(0.01, stream.put, TokenChunk("r", 0, [5], "five"))
    assert isinstance(await stream.next(0.1), TokenChunk)  # leaves its timer armed for 0.1 s
    loop.call_later(0.3, stream.put, end())
    started = loop.time()
    assert isinstance(await stream.next(2.0), StreamEnd)
    assert loop.time() - started >= 0.25
    stream.close()


async def test_a_shorter_wait_times_out_on_its_own_deadline() -> None:
    loop = asyncio.get_running_loop()
    stream = ReplyStream("r", "s", lambda request_id: None)
    loop.call_later(0.01, stream.put, TokenChunk("r", 0, [5], "five"))
    assert isinstance(await stream.next(30.0), TokenChunk)  # leaves its timer armed for 30 s
    started = loop.time()
    with pytest.raises(RequestTimeout):
        await stream.next(0.05)
    assert loop.time() - started < 5.0
    released: list[str] = []
    closing = ReplyStream("r2", "s", released.append)
    closing.close()
    assert released == ["r2"]
