"""What the vLLM worker's front end costs per token: the benchmark's accounting, and vLLM's stat loggers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from contracts.messages import SamplingParams
from loadtest.dataplane.vllm_vs_direct import PathRun, cpu_ms_per_token, print_summary, report, summarise
from services.worker.engines.base import EngineRequest
from shared.config import VllmSettings
from tests.waiting import until


def test_cpu_per_token_counts_the_front_end_apart_from_the_engine_and_the_client() -> None:
    cpu_s = {"worker-w0": 0.5, "worker-w0/VLLM::EngineCore": 3.0, "ingress": 0.25, "nats-server": 0.25, "loadtest-client": 9.0}
    per_token = cpu_ms_per_token(cpu_s, completion_tokens=1000)
    assert per_token["worker-w0"] == pytest.approx(0.5)
    assert per_token["worker-w0/VLLM::EngineCore"] == pytest.approx(3.0)
    assert per_token["front_end"] == pytest.approx(1.0)  # worker, ingress and NATS only


def test_cpu_per_token_without_tokens_is_unknown_not_zero() -> None:
    assert cpu_ms_per_token({"ingress": 0.1}, completion_tokens=0) == {"ingress": None, "front_end": None}


def _run(tokens_per_s: float, ttft_ms: float, engine_s: float = 1.0) -> PathRun:
    return PathRun(wall_s=1.0, completion_tokens=int(tokens_per_s), ttft_s=[ttft_ms / 1000] * 3, itl_s=[0.01] * 3,
                   cpu_s={"front": 0.5, "front/VLLM::EngineCore": engine_s, "loadtest-client": 2.0})


def test_starts_are_summarised_by_the_median_of_paired_ratios() -> None:
    def start(fresh: float, warm: list[float]) -> dict:
        phases = {"fresh": report(_run(1000 * fresh, 100 + fresh), _run(1000, 100))}
        phases["warm"] = report(_run(1000, 50), _run(1000, 50)) | {"round_ratios": warm}
        return phases

    # One start's slow spell (its fresh 0.5, a warm round at 3.0) moves one pair, not the summary.
    summary = summarise([start(0.5, [0.9, 3.0]), start(0.95, [1.0, 1.05]), start(1.1, [0.97, 0.99])])
    assert summary["fresh"]["throughput_ratio"] == pytest.approx(0.95)
    assert summary["fresh"]["throughput_ratios"] == pytest.approx([0.5, 0.95, 1.1])
    assert summary["warm"]["throughput_ratio"] == pytest.approx(0.995)  # the median of all six warm rounds
    assert summary["fresh"]["ttft_diff_ms"]["p50_ms"] == pytest.approx(0.95)
    # The engine's CPU per token, apart from the front end's: 1 s over 950 tokens, 1,000 tokens.
    assert summary["fresh"]["engine_cpu_ms_per_token"] == pytest.approx({"kvlane": 1000 / 950, "direct": 1.0})
    assert summary["fresh"]["front_end_cpu_ms_per_token"] == pytest.approx({"kvlane": 500 / 950, "direct": 0.5})


def test_a_summary_has_only_the_phases_that_ran(capsys: pytest.CaptureFixture) -> None:
    only_fresh = [{"fresh": report(_run(900, 120), _run(1000, 100))}]
    summary = summarise(only_fresh)
    assert set(summary) == {"fresh"}
    print_summary({"concurrency": {"8": summary}})
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 1 and rows[0].split()[:5] == ["8", "fresh", "0.900", "0.900", "0.900"]


def test_a_figure_no_pair_has_is_unknown_in_the_summary() -> None:
    fresh = report(_run(900, 120), _run(1000, 100))
    fresh["front_end_cpu_ratio"] = None  # as when one path's CPU was not measured
    assert summarise([{"fresh": fresh}])["fresh"]["front_end_cpu_ratio"] is None


@pytest.mark.vllm
def test_the_step_counters_take_the_place_of_vllms_prometheus_logger() -> None:
    vllm_engine = pytest.importorskip("services.worker.engines.vllm_engine")
    from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager

    counters = vllm_engine.StepCounters(clock=lambda: 0.0)
    manager = StatLoggerManager(SimpleNamespace(), custom_stat_loggers=[vllm_engine._stat_logger_factory(counters)],
                                enable_default_loggers=False)
    prometheus = [logger for logger in manager.stat_loggers if isinstance(logger, PrometheusStatLogger)]
    # One logger, ours: vLLM added none of its own (whose histograms nobody here reads).
    assert len(manager.stat_loggers) == 1 and len(prometheus) == 1
    scheduler = SimpleNamespace(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5, prefix_cache_stats=None,
                                kv_connector_stats=None, running_lora_adapters={"a": 1}, waiting_lora_adapters={"a": 1, "b": 1})
    iteration = SimpleNamespace(prompt_token_stats=SimpleNamespace(computed=128), num_generation_tokens=2, num_preempted_reqs=0)
    manager.record(scheduler, iteration)
    assert (counters.running, counters.waiting, counters.kv_usage) == (2, 1, 0.5)
    # The adapters of running requests (b's only wait: they hold no slot).
    assert counters.adapters_running == ["a"]


class _StepwiseEngine:
    """Stands in for AsyncLLM: each request's outputs come when the test puts them."""

    errored = False

    def __init__(self) -> None:
        self.outputs: dict[str, asyncio.Queue] = {}
        self.collectors: dict[str, object] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.outputs)

    async def generate(self, prompt, sampling, request_id, lora_request=None):
        queue = self.outputs[request_id] = asyncio.Queue()
        try:
            while True:
                output = await queue.get()
                yield output
                if output.finished:
                    return
        finally:
            del self.outputs[request_id]

    async def add_request(self, request_id, prompt, sampling, lora_request=None):
        collector = SimpleNamespace(request_id=request_id, put=None, get_nowait=lambda: None, close=lambda: None)
        self.outputs[request_id] = collector  # type: ignore[assignment]
        self.collectors[request_id] = collector
        return collector

    async def abort(self, request_id, internal=False) -> None:
        self.outputs.pop(request_id, None)


def _output(finished: bool) -> SimpleNamespace:
    completion = SimpleNamespace(token_ids=[5], text="x", finish_reason="length" if finished else None)
    return SimpleNamespace(outputs=[completion], finished=finished, num_cached_tokens=0)


@pytest.mark.vllm
async def test_the_vllm_engine_counts_requests_prefilling_until_their_first_output() -> None:
    vllm_engine = pytest.importorskip("services.worker.engines.vllm_engine")
    resolved = SimpleNamespace(max_model_len=4096, block_size=16, shape=SimpleNamespace(vocab_size=None))
    engine = vllm_engine.VllmEngine(VllmSettings(), resolved, "m")  # type: ignore[arg-type]
    fake = engine._engine = _StepwiseEngine()  # type: ignore[assignment]
    assert engine.stats().prefilling == 0

    def request(request_id: str) -> EngineRequest:
        return EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2))

    generated = engine.generate(request("g"))
    first = asyncio.ensure_future(anext(generated))
    streamed: list = []
    stream = asyncio.ensure_future(engine.stream(request("s"), streamed.append))
    await until(lambda: engine.stats().prefilling == 2, 5, "both submissions counted")
    fake.outputs["g"].put_nowait(_output(finished=False))
    await first
    assert engine.stats().prefilling == 1
    fake.collectors["s"].put(_output(finished=False))
    assert engine.stats().prefilling == 0 and streamed
    # A request that ends before any output (aborted, refused) is not left counted.
    aborted = engine.generate(request("a"))
    pending = asyncio.ensure_future(anext(aborted))
    await until(lambda: engine.stats().prefilling == 1, 5, "the submission counted")
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending
    await aborted.aclose()
    fake.collectors["s"].put(_output(finished=True))
    await stream
    await generated.aclose()
    assert engine.stats().prefilling == 0
