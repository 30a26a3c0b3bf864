"""The sim engine's guards: what it refuses up front, and what a failed step does to the requests it runs."""

from __future__ import annotations

import asyncio

import pytest

from contracts.messages import SamplingParams
from services.worker.engines.base import EngineDeadError, EngineRequest, RequestRejected
from services.worker.engines.sim import SimEngine
from shared.config import SimSettings
from shared.tokenizer import SimTokenizer


def request(prompt: list[int], resumed: list[int] | None = None, max_tokens: int = 8) -> EngineRequest:
    return EngineRequest("r1", prompt, SamplingParams(max_tokens=max_tokens), resume_token_ids=resumed or [])


@pytest.mark.parametrize("resumed", [[-1], [5, 2**40], [SimTokenizer().vocab_size]])
def test_resumed_tokens_outside_the_vocabulary_are_refused(resumed: list[int]) -> None:
    # They would be appended to the sequence as if sampled, and a negative or huge id cannot be hashed into a block.
    engine = SimEngine(SimSettings(), SimTokenizer())
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.check(request([1, 2, 3], resumed))
    engine.check(request([1, 2, 3], [4, 5]))  # in the vocabulary: accepted


async def test_a_failed_step_fails_the_running_requests_instead_of_stalling_them(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = SimEngine(SimSettings(speed=100.0), SimTokenizer())

    def broken_step() -> None:
        raise OverflowError("a scheduler bug")

    monkeypatch.setattr(engine._scheduler, "step", broken_step)
    await engine.start()
    try:
        with pytest.raises(EngineDeadError, match="OverflowError: a scheduler bug"):
            async with asyncio.timeout(10):
                async for _ in engine.generate(request([1, 2, 3])):
                    pass
        with pytest.raises(EngineDeadError):  # and refuses what comes after
            engine.check(request([1, 2, 3]))
    finally:
        await engine.shutdown()
