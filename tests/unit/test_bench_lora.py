"""The LoRA options `kvlane bench` and `kvlane simulate` share, and how each counts adapter loads: no fleet."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from contracts.messages import EngineStats, Heartbeat, WorkerRegistration
from launch.tiny_model import MODEL_SHAPE
from loadtest.bench.adapters import ensure_tiny_adapters
from loadtest.bench.client import RequestRecord, StreamingClient
from loadtest.bench.command import build_parser as bench_parser, main as bench_main, plan_runs
from loadtest.bench.driver import DriveLimits, WorkloadDriver
from loadtest.bench.lora import DEFAULT_MAX_LORAS, adapter_summary, lora_sections, per_1k
from loadtest.bench.run import WorkerCounters, counters_of
from loadtest.bench.workloads import adapter_names, sessions
from loadtest.simulation.command import build_parser as simulate_parser, main as simulate_main
from shared.adapter_store import WEIGHTS_FILE, BaseShape, check_adapter_files, check_against_base, read_adapter_files

LORA_OPTIONS = {"--adapters", "--adapter-popularity", "--max-loras", "--max-cpu-loras"}
MAINS: dict[str, Callable[[list[str]], int]] = {"bench": bench_main, "simulate": simulate_main}


def _lora_group(parser) -> dict[str, str]:
    (group,) = [g for g in parser._action_groups if g.title == "LoRA adapters"]
    return {action.option_strings[0]: action.help for action in group._group_actions}


def test_both_commands_take_the_same_lora_options_from_one_place() -> None:
    bench, simulate = _lora_group(bench_parser()), _lora_group(simulate_parser())
    assert set(bench) == LORA_OPTIONS and bench == simulate
    argv = ["--rate", "1", "--adapters", "16", "--adapter-popularity", "zipf:1.1", "--max-loras", "2", "--max-cpu-loras", "8"]
    for parser in (bench_parser(), simulate_parser()):
        args = parser.parse_args(argv)
        assert (args.adapters, args.adapter_popularity, args.max_loras, args.max_cpu_loras) == (16, 1.1, 2, 8)
        assert lora_sections(args) == {"worker.lora": {"max_loras": 2, "max_cpu_loras": 8}}
    defaults = bench_parser().parse_args(["--rate", "1"])
    assert (defaults.adapters, defaults.adapter_popularity) == (0, 1.0)
    assert lora_sections(defaults) == {}  # without adapters the fleet's workers serve none
    assert lora_sections(bench_parser().parse_args(["--adapters", "3"])) == {"worker.lora": {"max_loras": DEFAULT_MAX_LORAS}}


@pytest.mark.parametrize("command", sorted(MAINS))
@pytest.mark.parametrize(("argv", "complaint"), [
    (["--adapters", "-1"], "--adapters"),
    (["--adapters", "four"], "--adapters"),
    (["--adapters", "4", "--adapter-popularity", "uniform"], "expected zipf:S"),
    (["--adapters", "4", "--adapter-popularity", "zipf:-1"], "expected zipf:S"),
    (["--adapters", "4", "--adapter-popularity", "zipf:nan"], "expected zipf:S"),
    (["--adapters", "4", "--adapter-popularity", "zipf:"], "expected zipf:S"),
    (["--adapters", "4", "--max-loras", "0"], "--max-loras of 1 or more"),
    (["--adapters", "4", "--max-cpu-loras", "-2"], "--max-cpu-loras"),
])
def test_bad_lora_options_are_argparse_errors(command: str, argv: list[str], complaint: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        MAINS[command]([*argv, "--rate", "1", "--requests", "2", "--out", str(tmp_path), "--quiet"])
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_the_live_bench_plans_workers_with_adapter_slots_and_sessions_with_adapters(tmp_path: Path) -> None:
    args = bench_parser().parse_args(["--policies", "round_robin", "--workers", "2", "--rate", "5", "--requests", "40",
                                      "--adapters", "4", "--adapter-popularity", "zipf:1.1", "--max-loras", "2"])
    (run,), _ = plan_runs(args, tmp_path)
    assert run.fleet.overrides == {"worker.lora": {"max_loras": 2}}
    assert (run.workload.adapters, run.workload.adapter_zipf) == (4, 1.1)
    assert run.adapters_dir == tmp_path / "adapters"
    assert {s.adapter for s in sessions(run.workload)} <= set(adapter_names(4))
    without, _ = plan_runs(bench_parser().parse_args(["--policies", "round_robin", "--rate", "5"]), tmp_path)
    assert without[0].workload.adapters == 0 and without[0].adapters_dir is None


def test_loads_per_1000_requests_measured_and_over_the_whole_run() -> None:
    assert adapter_summary(measured_loads=6, measured_requests=40, all_loads=9, all_requests=60) == {
        "loads": 6, "loads_per_1k": 150.0, "loads_whole_run": 9, "loads_per_1k_whole_run": 150.0}
    assert per_1k(3, 0) is None  # no request measured: no rate, rather than a division by zero
    assert adapter_summary(0, 10, 0, 10)["loads_per_1k"] == 0.0


def _heartbeat(worker_id: str, adapter_loads: int, kv_pulls: int = 0) -> Heartbeat:
    registration = WorkerRegistration(worker_id=worker_id, role="aggregated", model="kvlane-sim", engine="sim",
                                      inbox=f"inbox.{worker_id}", block_size=16, max_model_len=4096, tokenizer="sim",
                                      started_at=0.0, host="here", max_loras=2)
    return Heartbeat(registration, EngineStats(adapter_loads=adapter_loads, kv_pulls=kv_pulls), sent_at=1.0, seq=1)


def test_worker_counters_sum_the_fleets_heartbeats_and_count_the_difference() -> None:
    before = counters_of([_heartbeat("w0", 1), _heartbeat("w1", 0, kv_pulls=2)])
    after = counters_of([_heartbeat("w0", 7), _heartbeat("w1", 4, kv_pulls=5)])
    assert before == WorkerCounters(kv_pulls=2, adapter_loads=1)
    assert after.since(before) == WorkerCounters(kv_pulls=3, adapter_loads=10)
    assert counters_of([]) == WorkerCounters()


def test_tiny_adapters_are_made_once_and_fit_the_tiny_model(tmp_path: Path) -> None:
    made = ensure_tiny_adapters(tmp_path, adapter_names(3))
    assert list(made) == ["adapter-0", "adapter-1", "adapter-2"]
    files = {name: read_adapter_files(path) for name, path in made.items()}
    for adapter in files.values():
        assert check_adapter_files(adapter).rank > 0
        check_against_base(adapter, BaseShape.of_config(MODEL_SHAPE))
    assert len({adapter[WEIGHTS_FILE] for adapter in files.values()}) == 3  # each its own weights
    stamps = {name: path.stat().st_mtime_ns for name, path in made.items()}
    again = ensure_tiny_adapters(tmp_path, adapter_names(3))
    assert again == made and {name: path.stat().st_mtime_ns for name, path in again.items()} == stamps


async def test_each_request_names_its_sessions_adapter_as_its_model() -> None:
    models: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        models.append((await request.json())["model"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": " hi", "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    spec = bench_parser().parse_args(["--policies", "round_robin", "--workload", "sharegpt", "--rate", "50", "--requests", "12", "--adapters", "3"])
    (run,), _ = plan_runs(spec, Path("unused"))
    async with TestServer(app, host="127.0.0.1") as server:
        async with StreamingClient(str(server.make_url("")), "kvlane-sim", 10.0, time.perf_counter()) as client:
            records = await WorkloadDriver(client, DriveLimits(issue_for_s=10, hard_stop_s=20)).run(sessions(run.workload))
        base = RequestRecord("warmup", "warmup", 0, "completions", 1, 0.0)
        async with StreamingClient(str(server.make_url("")), "kvlane-sim", 10.0, time.perf_counter()) as client:
            await client.send(base, {"prompt": " warm up"})
    assert len(records) == 12 and all(r.ok for r in records)
    drawn = {s.session_id: s.adapter for s in sessions(run.workload)}
    assert [r.model for r in records] == [drawn[r.session_id] for r in records]
    assert sorted(models[:-1]) == sorted(r.model for r in records) and set(models[:-1]) <= set(adapter_names(3))
    assert base.model == models[-1] == "kvlane-sim"  # a record without an adapter names the client's model
    assert all(record.to_json()["model"] for record in records)
