"""`kvlane simulate` predicts `kvlane bench` on the same options: a live sim fleet of 4 nodes against its simulation.

The simulation runs the same scheduler, router and allocation code; what it
takes as given are the control plane's delays (`Latencies`: ingress, one
message, the route decision, the hand-over to the worker, the stream back,
a live engine's step overhead). Those are the host's: they grow on a
slower machine and with the load that four workers, the services, NATS,
Redis and the load generator put on two cores. So the test runs
`loadtest.fidelity --calibrate`, which measures them first from a traced
live run on the same machine (`loadtest.simulation.calibration`).

Tolerances (median over the three policies of |simulated - live| / live):
goodput 10%, TTFT p50 and p90 30%. Measured on the idle 2-core development
machine, calibrated: goodput 0.2-0.3%, TTFT p50 1.1% and 5.4%, p90 10.2%
and 15.5% (two runs; one policy alone reached 38% at p90). With the
default latencies the same runs erred 50-53% on TTFT p50, so the old
uncalibrated bound of 50% no longer held on that machine.
"""

from __future__ import annotations

import json

import pytest

from kvlane.launcher import servers_available
from loadtest.fidelity import main

pytestmark = pytest.mark.integration

GOODPUT_TOLERANCE = 0.10
TTFT_TOLERANCE = 0.30


@pytest.mark.skipif(not servers_available(), reason="needs nats-server and redis-server")
@pytest.mark.timeout(480)
def test_simulation_agrees_with_the_live_bench(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    code = main(["--out", str(tmp_path), "--workers", "4", "--rate", "20", "--requests", "300", "--groups", "16",
                 "--policies", "round_robin,least_loaded,jffc_per_request", "--seed", "1", "--calibrate"])
    assert code == 0
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert len(result["runs"]) == 3
    errors = result["median_error"]
    assert errors["goodput"] <= GOODPUT_TOLERANCE, result
    assert errors["ttft_p50"] <= TTFT_TOLERANCE, result
    assert errors["ttft_p90"] <= TTFT_TOLERANCE, result
