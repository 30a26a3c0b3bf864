"""`kvlane bench` end to end: two policies, each on a fresh two-worker fleet, JSON and plots written.

Only shape and success are checked, never timing: the numbers depend on the machine.
"""

from __future__ import annotations

import json

import pytest

from launch.launcher import servers_available
from loadtest.bench.command import build_parser, main, plan_runs
from loadtest.bench.workloads import sessions

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(120)
def test_bench_compares_two_policies_and_writes_results(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    code = main([
        "--policies", "round_robin,least_loaded", "--workers", "2", "--profile", "zero",
        "--workload", "shared-prefix", "--groups", "3", "--system-tokens", "128", "--question-tokens", "16",
        "--output-tokens", "8", "--rate", "20", "--requests", "30", "--seed", "3",
        "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet",
    ])

    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["parameters"]["rejected_policies"] == {}
    assert results["parameters"]["fleet"]["workers"] == 2
    runs = {run["policy"]: run for run in results["runs"]}
    assert set(runs) == {"round_robin", "least_loaded"}
    for policy, run in runs.items():
        assert "error" not in run, run.get("error")
        assert run["processes_died"] == []
        summary = run["summary"]
        assert summary["requests"] == summary["succeeded"] == 30, summary["errors"]
        assert summary["ttft_ms"]["count"] == 30 and summary["ttft_ms"]["p50"] > 0
        assert summary["output_tokens"] == 30 * 8
        assert summary["goodput_rps"] > 0
        # Every request was matched to the worker that ran it.
        assert summary["finished_events_matched"] == 30
        assert sum(summary["requests_per_worker"].values()) == 30
        assert set(summary["requests_per_worker"]) == {"w0", "w1"}
        assert len(run["records"]) == 30
        assert all(r["request_id"] and len(r["token_times_s"]) == 8 for r in run["records"])
    # Round robin alternates, so its load is even.
    assert runs["round_robin"]["summary"]["load_cv"] == pytest.approx(0.0, abs=0.1)
    # The same seeded workload went to both fleets.
    sessions = [[(r["session_id"], r["scheduled_s"]) for r in runs[p]["records"]] for p in runs]
    assert sorted(sessions[0]) == sorted(sessions[1])
    assert (out / "ttft_cdf.png").stat().st_size > 0
    assert (out / "goodput.png").stat().st_size > 0


def test_bench_rejects_contradictory_load_options(tmp_path) -> None:
    assert main(["--concurrency", "4", "--rate", "2", "--out", str(tmp_path), "--quiet"]) == 2
    assert main(["--policies", "round_robin", "--out", str(tmp_path), "--quiet"]) == 2  # no rate, no concurrency
    # A warm-up comes before a --duration of arrivals, and lasts a number of seconds.
    for warmup in (["--warmup", "5"], ["--warmup", "5", "--duration", "5", "--requests", "10"],
                   ["--warmup", "-1", "--duration", "5"], ["--warmup", "nan", "--duration", "5"]):
        assert main([*warmup, "--rate", "2", "--out", str(tmp_path), "--quiet"]) == 2, warmup


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(120)
def test_bench_serves_a_warm_up_and_measures_only_what_comes_after_it(tmp_path) -> None:
    out = tmp_path / "out"
    code = main([
        "--policies", "jffc_per_request", "--workers", "1", "--profile", "zero", "--workload", "shared-prefix",
        "--groups", "2", "--system-tokens", "128", "--question-tokens", "16", "--output-tokens", "4",
        "--rate", "20", "--warmup", "1.5", "--duration", "1.5", "--seed", "3",
        "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet",
    ])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["parameters"]["warmup_s"] == 1.5
    (run,) = results["runs"]
    assert "error" not in run, run.get("error")
    # Arrivals for 3 s at 20 req/s: the first 1.5 s served, left out; the rest counted, every one of them.
    assert run["warmup_requests"] > 0 and run["records"]
    assert all(r["scheduled_s"] >= 1.5 and r["status"] == 200 for r in run["records"])
    assert run["summary"]["requests"] == run["summary"]["succeeded"] == len(run["records"])


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(90)
def test_bench_multi_turn_feeds_answers_back_and_hits_the_prefix_cache(tmp_path) -> None:
    out = tmp_path / "out"
    code = main([
        "--policies", "least_loaded", "--workers", "2", "--profile", "zero", "--workload", "multi-turn",
        "--turns", "3", "--groups", "2", "--system-tokens", "64", "--question-tokens", "16", "--output-tokens", "16",
        "--concurrency", "4", "--requests", "12", "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet",
    ])

    assert code == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    summary = run["summary"]
    assert summary["succeeded"] == summary["requests"] == 12, summary["errors"]
    by_conversation: dict[str, list[dict]] = {}
    for record in run["records"]:
        by_conversation.setdefault(record["session_id"], []).append(record)
    assert len(by_conversation) == 4
    for turns in by_conversation.values():
        turns.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        # Each turn's prompt holds the previous prompt and the answer received: it grows by more than the answer.
        prompts = [r["prompt_tokens"] for r in turns]
        assert all(later > earlier + 16 for earlier, later in zip(prompts, prompts[1:]))
        # Turns are sequential: the next is sent only after the previous answer ended.
        assert all(b["sent_s"] >= a["end_s"] for a, b in zip(turns, turns[1:]))
    assert summary["prefix_cache_hit_rate"] > 0.3


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(120)
def test_bench_runs_a_mixed_fleet_with_a_profile_and_speed_per_node(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    code = main([
        # w1 steps in about 0.26 s (13 ms at a twentieth of the speed), w0 in no time.
        "--policies", "round_robin", "--fleet", "zero:1,h100-80g-llama3-70b-tp4@0.05:1", "--workload", "shared-prefix", "--groups", "2",
        "--system-tokens", "64", "--question-tokens", "8", "--output-tokens", "4", "--rate", "10", "--requests", "20",
        "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet",
    ])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    fleet = results["parameters"]["fleet"]
    assert fleet["workers"] == 2
    assert [(n["worker_id"], n["profile"], n["speed"]) for n in fleet["mix"]] == [
        ("w0", "zero", 1.0), ("w1", "h100-80g-llama3-70b-tp4", 0.05)]
    (run,) = results["runs"]
    assert run["summary"]["succeeded"] == 20 and run["summary"]["requests_per_worker"] == {"w0": 10, "w1": 10}
    # Each worker runs its own profile at its own speed: half the answers take four slow steps.
    e2e = sorted(r["end_s"] - r["sent_s"] for r in run["records"])
    assert e2e[9] < 0.5 < 0.9 < e2e[10]


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(120)
def test_bench_sends_tenants_and_reports_each(tmp_path) -> None:
    out = tmp_path / "out"
    code = main([
        "--policies", "jffc_per_request", "--workers", "1", "--profile", "zero", "--workload", "shared-prefix",
        "--groups", "2", "--system-tokens", "64", "--question-tokens", "8", "--output-tokens", "4", "--rate", "20",
        "--requests", "40", "--tenants", "a:3,b:1:2", "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet",
    ])
    assert code == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    tenants = run["summary"]["tenants"]["per_tenant"]
    assert set(tenants) == {"a", "b"} and tenants["a"]["requests"] > tenants["b"]["requests"]
    assert (tenants["a"]["weight"], tenants["b"]["weight"]) == (1.0, 2.0)
    assert all(t["succeeded"] == t["requests"] for t in tenants.values())
    assert {r["tenant"] for r in run["records"]} == {"a", "b"}


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(120)
def test_bench_publishes_adapters_sends_each_sessions_and_counts_the_workers_loads(tmp_path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    argv = ["--policies", "round_robin", "--workers", "2", "--profile", "zero", "--workload", "shared-prefix",
            "--groups", "2", "--system-tokens", "64", "--question-tokens", "8", "--output-tokens", "4", "--rate", "12",
            "--warmup", "1", "--duration", "2.5", "--seed", "4", "--adapters", "4", "--max-loras", "2"]
    assert main([*argv, "--out", str(out), "--log-dir", str(logs), "--quiet"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["parameters"]["fleet"]["lora"]["max_loras"] == 2
    (run,) = results["runs"]
    assert "error" not in run, run.get("error")
    summary, records = run["summary"], run["records"]
    assert summary["requests"] == summary["succeeded"] == len(records) > 0, summary["errors"]
    assert set(summary["requests_per_worker"]) == {"w0", "w1"}
    # Each request named its session's adapter as its model, the same adapter for the same session in any run.
    (planned,), _ = plan_runs(build_parser().parse_args(argv), tmp_path / "planned")
    drawn = {session.session_id: session.adapter for session in sessions(planned.workload)}
    assert all(record["model"] == drawn[record["session_id"]] for record in records)
    sent = {record["model"] for record in records}
    assert len(sent) > 1 and sent <= {"adapter-0", "adapter-1", "adapter-2", "adapter-3"}
    # The workers fetched the adapters they ran from the bus (objects adapters/<name>/<revision> in their cache),
    # and their heartbeats counted the loads into batch slots.
    fetched = {entry.name.split("_")[1] for entry in (logs / "round_robin-r12" / "adapter-cache").iterdir()}
    assert sent <= fetched
    adapters = run["adapters"]
    assert adapters["loads_whole_run"] >= adapters["loads"] > 0
    assert adapters["loads_per_1k"] == pytest.approx(1000.0 * adapters["loads"] / len(records))
    assert adapters["loads_per_1k_whole_run"] == pytest.approx(
        1000.0 * adapters["loads_whole_run"] / (len(records) + run["warmup_requests"]))


def test_kvlane_up_refuses_a_bad_fleet_before_starting_anything() -> None:
    from kvlane.cli import main as kvlane_main

    with pytest.raises(SystemExit) as exit_info:
        kvlane_main(["up", "--fleet", "no-such-gpu:2"])
    assert exit_info.value.code == 2
