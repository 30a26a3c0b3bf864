"""`loadtest.routing.disagg_bench --quick` end to end: two sim nodes, aggregated vs 1P:1D, one rate, JSON and plot written.

Only shape, success and sane numbers are checked, never which layout wins: timing depends on the machine.
"""

from __future__ import annotations

import json

import pytest

from launch.launcher import servers_available
from loadtest.routing.disagg_bench import capacity, main, parse_layouts

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(120)
def test_quick_disagg_bench_runs_both_layouts_and_writes_results(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    code = main(["--quick", "--out", str(out), "--log-dir", str(tmp_path / "logs"), "--quiet"])

    assert code == 0
    results = json.loads((out / "results.json").read_text())
    params = results["parameters"]
    assert params["nodes"] == 2 and params["speed"] == 1.0 and params["kv_link"] == "rdma-400g"
    assert [layout["name"] for layout in params["layouts"]] == ["2 agg", "1P:1D"]
    runs = {run["layout"]: run for run in results["runs"]}
    assert set(runs) == {"2 agg", "1P:1D"}
    for name, run in runs.items():
        assert "error" not in run, run.get("error")
        assert run["processes_died"] == []
        summary, sim = run["summary"], run["sim"]
        assert summary["requests"] == summary["succeeded"] >= 2, summary["errors"]
        assert summary["output_tokens"] == summary["requests"] * 16
        assert all(r["prompt_tokens"] >= 512 for r in run["records"])
        assert 0 < sim["ttft_ms"]["p50"] <= sim["ttft_ms"]["p99"] < 10_000
        assert 0 < sim["tpot_ms"]["p50"] <= sim["tpot_ms"]["p99"] < 1_000
        assert 0.0 <= sim["slo_attainment"] <= 1.0
        assert sim["goodput_rps"] == pytest.approx(run["rate"] * sim["slo_attainment"])
        assert sim["request_throughput_rps"] > 0
        # Every request was matched to the node that generated it.
        assert summary["finished_events_matched"] == summary["requests"]
    # The aggregated nodes ran everything themselves; on 1P:1D the prompts (512 tokens, over the
    # 256-token threshold) were prefilled on p0, and d0 generated every answer.
    assert runs["2 agg"]["sim"]["remote_prefill_share"] == 0.0
    assert runs["1P:1D"]["sim"]["remote_prefill_share"] == 1.0
    assert set(runs["2 agg"]["summary"]["requests_per_worker"]) == {"w0", "w1"}
    per_worker = runs["1P:1D"]["summary"]["requests_per_worker"]
    assert per_worker["p0"] == 0 and per_worker["d0"] == runs["1P:1D"]["summary"]["requests"]
    # The same seeded workload and arrival times went to both fleets.
    sessions = [sorted((r["session_id"], r["scheduled_s"]) for r in run["records"]) for run in runs.values()]
    assert sessions[0] == sessions[1]
    comparison = results["comparison"]
    assert set(comparison["capacity_rps"]) == {"2 agg", "1P:1D"}
    assert [row["best_disaggregated"] for row in comparison["per_rate"]] == ["1P:1D"]
    assert set(comparison["capacity_by_slo_scale"]) == {"0.5", "1", "2", "4"}
    assert (out / "disagg.png").stat().st_size > 0
    # --report re-derives the same figures from the records, without a fleet.
    (out / "disagg.png").unlink()
    assert main(["--report", str(out / "results.json"), "--quiet"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["comparison"] == comparison
    assert [run["sim"] for run in again["runs"]] == [run["sim"] for run in results["runs"]]
    assert (out / "disagg.png").stat().st_size > 0


def test_layouts_and_capacity_arithmetic() -> None:
    assert [layout.name for layout in parse_layouts(4, "1:3,2:2,3:1")] == ["4 agg", "1P:3D", "2P:2D", "3P:1D"]
    with pytest.raises(ValueError, match="add up"):
        parse_layouts(4, "1:2")
    with pytest.raises(ValueError, match="P:D"):
        parse_layouts(4, "2-2")
    # 90% is crossed halfway between 20 (100%) and 30 (80%).
    assert capacity([(10, 1.0), (20, 1.0), (30, 0.8)], 0.9) == pytest.approx(25.0)
    assert capacity([(10, 0.95), (20, 0.92)], 0.9) == 20
    assert capacity([(10, 0.5), (20, 0.2)], 0.9) is None


def test_bad_options_exit_2(tmp_path) -> None:
    assert main(["--ratios", "1:1", "--out", str(tmp_path), "--quiet"]) == 2  # 1 + 1 is not 4 nodes
    assert main(["--rates", "0", "--out", str(tmp_path), "--quiet"]) == 2
    (tmp_path / "results.json").write_text("{}")
    assert main(["--report", str(tmp_path / "results.json"), "--quiet"]) == 2
