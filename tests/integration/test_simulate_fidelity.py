"""`kvlane simulate` predicts `kvlane bench` on the same options: a live sim fleet of 4 nodes against its simulation.

Tolerances (median over the three policies of |simulated - live| / live):
goodput 10%, TTFT p50 and p90 50%. Measured on the 2-core development
machine: goodput 0.3%, TTFT p50 10%, p90 6% (docs/benchmarks.md, "Fidelity");
on a later machine of the same kind, idle, TTFT p50 32-40% and p90 14-23%,
the same with the code as it was before the latest changes (the live
TTFT p50 rose from about 24 to 30-39 ms; the simulated one is 21.7 ms).
TTFT gets more room than goodput because the simulation's control-plane
latencies are constants (`loadtest.simulation.world.Latencies`), while on
a small CI machine the live control plane shares two cores with four
workers and the load generator, and its delays grow with that load; the
goodput bound is the issue's own.
"""

from __future__ import annotations

import json

import pytest

from kvlane.launcher import servers_available
from loadtest.fidelity import main

pytestmark = pytest.mark.integration

GOODPUT_TOLERANCE = 0.10
TTFT_TOLERANCE = 0.50


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(480)
def test_simulation_agrees_with_the_live_bench(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    code = main(["--out", str(tmp_path), "--workers", "4", "--rate", "20", "--requests", "300", "--groups", "16",
                 "--policies", "round_robin,least_loaded,jffc_per_request", "--seed", "1"])
    assert code == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert len(result["runs"]) == 3
    errors = result["median_error"]
    assert errors["goodput"] <= GOODPUT_TOLERANCE, result
    assert errors["ttft_p50"] <= TTFT_TOLERANCE, result
    assert errors["ttft_p90"] <= TTFT_TOLERANCE, result
