"""The overhead benchmark runs end to end on a real fleet and writes sane JSON.

Only shape and success are checked, never timing thresholds: the numbers
depend on the machine.
"""

from __future__ import annotations

import json
import math

import pytest

from launch.launcher import servers_available
from loadtest.dataplane.overhead import BenchOptions, run_benchmark

pytestmark = pytest.mark.integration


def _positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(180)
def test_overhead_benchmark_writes_complete_results(tmp_path):
    out = tmp_path / "results" / "overhead.json"
    options = BenchOptions(requests=20, concurrency=4, duration_s=2.0, warmup=5, out=out,
                           log_dir=tmp_path / "logs", quiet=True, http_floor=True, path_floor=True)

    returned = run_benchmark(options)

    results = json.loads(out.read_text())
    assert results == json.loads(json.dumps(returned))
    assert {"benchmark", "timestamp", "machine", "parameters", "latency", "throughput"} <= results.keys()
    assert results["machine"]["cpu_count"] >= 1
    assert results["machine"]["python_version"]
    assert results["parameters"] | {"requests": 20, "concurrency": 4, "duration_s": 2.0, "max_tokens": 1,
                                    "worker_profile": "zero"} == results["parameters"]
    assert results["parameters"]["prompt_tokens"] >= 1

    assert [p["path"] for p in results["parameters"]["ingress_paths"] if p["floor"]] == ["http-floor", "path-floor", "path-floor-1"]
    latency = results["latency"]
    paths = ("ingress", "http-floor", "path-floor", "path-floor-1", "direct")
    for path in paths:
        stats = latency[path]
        assert stats["errors"] == 0, stats["error_kinds"]
        assert stats["count"] == 20
        for key in ("p50_ms", "p90_ms", "p99_ms", "mean_ms", "min_ms", "max_ms"):
            assert _positive(stats[key]), (path, key, stats[key])
        assert stats["min_ms"] <= stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    overhead = latency["overhead"]
    for key in ("p50_ms", "p99_ms", "mean_ms", "paired_median_ms"):
        assert isinstance(overhead[key], float) and math.isfinite(overhead[key])  # a difference: may be negative
    for key in ("ratio_p50", "ratio_p99", "ratio_mean"):
        assert _positive(overhead[key])

    throughput = results["throughput"]
    for path in paths:
        run = throughput[path]
        assert run["errors"] == 0, run["error_kinds"]
        assert run["succeeded"] == run["requests"] > 0
        assert run["concurrency"] == 4
        for key in ("requests_per_s", "elapsed_s", "p50_ms", "p99_ms"):
            assert _positive(run[key]), (path, key, run[key])
        assert {"ingress", "balancer", "worker-w0", "http-floor", "path-floor", "path-floor-relay", "path-floor-1",
                "loadtest-client"} <= run["cpu_percent"].keys()
    for path in paths[:-1]:
        assert _positive(throughput[f"{path}_vs_direct"])
    # The floor's relay, in the balancer's place, works only while requests go through it.
    assert throughput["path-floor"]["cpu_ms_per_request"]["path-floor-relay"] > throughput["direct"]["cpu_ms_per_request"]["path-floor-relay"]
