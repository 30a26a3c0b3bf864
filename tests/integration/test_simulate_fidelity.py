"""`kvlane simulate` predicts `kvlane bench` on the same options: a live sim fleet of 4 nodes against its simulation.

The simulation runs the same scheduler, router and allocation code; what it
takes as given are the control plane's delays (`Latencies`: ingress, one
message, the route decision, the hand-over to the worker, the stream back,
a live engine's step overhead). Those are the host's: they grow on a
slower machine and with the load that four workers, the services, NATS,
Redis and the load generator put on two cores, and they vary request by
request. So the test runs `loadtest.simulation.fidelity --calibrate`, which measures
them first from a traced live run on the same machine
(`loadtest.simulation.calibration`), and the simulation draws each
request's delays from their measured distributions.

Tolerances (median over the three policies of |simulated - live| / live):
goodput 10%; TTFT p50 and p90 20% plus the calibration's drift. The
calibration is a separate live run before the compared ones, and this
host's own speed changes between the two windows (identical live runs
here differ by up to a third at TTFT p50); `fidelity.json`'s
`calibration_drift` is how much slower or faster the calibration run's
TTFT p50 was than the same requests' in the compared run of its policy,
and no simulation calibrated on the one window can be closer than that
to the other. Measured on the 2-core development machine, eight runs of
this test's options (drift -5.0, +7.1, -1.8, +0.8, +54.4, +23.0, +10.0
and +4.8%): goodput 0.0-0.2%, TTFT p50 3.0, 6.3, 11.1, 6.7, 31.0, 37.2,
7.6 and 5.8%, TTFT p90 1.4, 2.0, 5.4, 5.1, 9.8, 14.8, 4.7 and 0.6%: the
six runs of small drift stay within 11.1%, about half the bound, and the two of
large drift within their bounds by 5.8 points or more. (With each delay
at its measured median instead, the same runs erred 1.0-23.1% at p50.)
One more run, the policies in reverse order, calibrated on a window 86%
slower than its compared run and erred 139% at p50, beyond its bound: a
host that busy during the calibration fails this test.
8 nodes are not tested: a run takes over five minutes on two cores,
and there the live fleet saturates the machine and its TTFT moves
21-74% between identical runs.
"""

from __future__ import annotations

import json

import pytest

from launch.launcher import servers_available
from loadtest.simulation.fidelity import main

pytestmark = pytest.mark.integration

GOODPUT_TOLERANCE = 0.10
# Beside the calibration's drift (`calibration_drift`), which is added to it.
TTFT_TOLERANCE = 0.20


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
    drift = result["calibration_drift"]
    assert drift is not None, result
    assert errors["ttft_p50"] <= TTFT_TOLERANCE + abs(drift), result
    assert errors["ttft_p90"] <= TTFT_TOLERANCE + abs(drift), result
