"""vLLM outputs handed to a callback from AsyncLLM's output handler (`VllmEngine.stream`), on one embedded engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from contracts.messages import SamplingParams
from services.worker.engines.base import EngineOutput, EngineRequest, PushesOutputs
from shared.config import WorkerSettings
from tests.vllm.conftest import MODEL, engine_environment, vllm_settings

pytestmark = [pytest.mark.vllm]

PROMPT = [11 + (i * 37) % 900 for i in range(70)]


@pytest.fixture(scope="module")
async def engine(tiny_model: Path) -> AsyncIterator:
    from services.worker.engines.vllm_setup import build_vllm_engine

    with engine_environment():
        engine, _ = build_vllm_engine(WorkerSettings(model=MODEL, engine="vllm", vllm=vllm_settings(tiny_model)))
        await engine.start()
        yield engine
        await engine.shutdown()


def request(request_id: str, max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def unfinished(engine) -> int:
    return engine._running().get_num_unfinished_requests()


async def test_pushed_outputs_are_the_generated_ones(engine) -> None:
    assert isinstance(engine, PushesOutputs)
    pushed: list[EngineOutput] = []
    await engine.stream(request("pushed", 12), pushed.append)
    pulled = [output async for output in engine.generate(request("pulled", 12))]
    assert [t for o in pushed for t in o.token_ids] == [t for o in pulled for t in o.token_ids]
    assert len([t for o in pushed for t in o.token_ids]) == 12
    assert "".join(o.text for o in pushed) == "".join(o.text for o in pulled)
    assert [o.finish_reason for o in pushed][-1] == "length"
    assert all(o.finish_reason is None for o in pushed[:-1])
    assert unfinished(engine) == 0


async def test_cancelling_the_stream_aborts_the_request_in_the_engine(engine) -> None:
    three = asyncio.Event()
    pushed: list[EngineOutput] = []

    def on_output(output: EngineOutput) -> None:
        pushed.append(output)
        if len(pushed) == 3:
            three.set()

    running = asyncio.create_task(engine.stream(request("left", 900), on_output))
    await three.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert unfinished(engine) == 0
    delivered = len(pushed)
    # The engine delivers nothing more for it: another request runs to its end meanwhile.
    await engine.stream(request("after", 8), lambda _: None)
    assert len(pushed) == delivered and pushed[-1].finish_reason is None


async def test_a_failing_callback_ends_and_aborts_its_request(engine) -> None:
    def on_output(output: EngineOutput) -> None:
        raise LookupError("no stream for this output")

    with pytest.raises(LookupError):
        await engine.stream(request("failing", 900), on_output)
    assert unfinished(engine) == 0
    assert not engine.errored  # vLLM's output handler never saw the exception
